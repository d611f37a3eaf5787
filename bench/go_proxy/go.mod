module aresgateway/bench/goproxy

go 1.19
