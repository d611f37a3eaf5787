// Command go_proxy is a benchmark reference of the ares-proxy design, not part
// of the product: agent requests (any POST but /respond) are parked until a
// poller answers them; GET /poll is non-blocking and destructive (it ignores
// "wait" and hands out what is pending at once); POST /respond answers ids.
//
// Usage: go_proxy PORT  (listens on 127.0.0.1:PORT only, then prints "ready").
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

type item struct {
	id   string
	body []byte
	ts   float64
}

type proxy struct {
	counter uint64
	mu      sync.Mutex
	queue   []*item
	waiting map[string]chan []byte
}

func reply(w http.ResponseWriter, code int, body string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	io.WriteString(w, body)
}

// park holds an agent request until it is answered, the client goes away or
// 15 minutes pass. Bodies must be JSON, as they are embedded raw in /poll.
func (p *proxy) park(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil || !json.Valid(body) {
		reply(w, http.StatusBadRequest, `{"error":"request body must be JSON"}`)
		return
	}
	id := "req_" + strconv.FormatUint(atomic.AddUint64(&p.counter, 1), 10)
	ch := make(chan []byte, 1)
	p.mu.Lock()
	p.queue = append(p.queue, &item{id, body, float64(time.Now().UnixNano()) / 1e9})
	p.waiting[id] = ch
	p.mu.Unlock()

	timer := time.NewTimer(15 * time.Minute)
	defer timer.Stop()
	select {
	case answer := <-ch:
		reply(w, http.StatusOK, string(answer))
	case <-timer.C:
		p.forget(id)
		reply(w, http.StatusGatewayTimeout, `{"error":"no response within 15 minutes"}`)
	case <-r.Context().Done():
		p.forget(id)
	}
}

// forget drops a parked request from the map and, if not yet polled, the queue.
func (p *proxy) forget(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.waiting, id)
	for i, it := range p.queue {
		if it.id == id {
			p.queue = append(p.queue[:i], p.queue[i+1:]...)
			break
		}
	}
}

// poll takes up to max pending items (default all) off the queue, never waiting.
func (p *proxy) poll(w http.ResponseWriter, r *http.Request) {
	max, err := strconv.Atoi(r.URL.Query().Get("max"))
	if err != nil || max <= 0 {
		max = -1
	}
	var taken []*item
	p.mu.Lock()
	i := 0
	for ; i < len(p.queue) && len(taken) != max; i++ {
		if _, ok := p.waiting[p.queue[i].id]; ok { // skip ids answered early
			taken = append(taken, p.queue[i])
		}
	}
	p.queue = append([]*item(nil), p.queue[i:]...)
	p.mu.Unlock()

	var buf bytes.Buffer
	buf.WriteByte('[')
	for k, it := range taken {
		if k > 0 {
			buf.WriteByte(',')
		}
		fmt.Fprintf(&buf, `{"id":%q,"request":%s,"timestamp":%.6f}`, it.id, it.body, it.ts)
	}
	buf.WriteByte(']')
	reply(w, http.StatusOK, buf.String())
}

type answer struct {
	ID         string          `json:"id"`
	Response   json.RawMessage `json:"response"`
	Completion *struct {
		Text string `json:"text"`
	} `json:"completion"`
}

// deliver hands one answer to its parked agent and returns an HTTP status.
func (p *proxy) deliver(a answer) int {
	body := []byte(a.Response)
	if len(body) == 0 || string(body) == "null" {
		if a.Completion == nil {
			return http.StatusBadRequest
		}
		text, _ := json.Marshal(a.Completion.Text)
		body = []byte(fmt.Sprintf(`{"id":"chatcmpl-%s","object":"chat.completion","created":0,`+
			`"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":%s},`+
			`"finish_reason":"stop"}]}`, a.ID, text))
	}
	p.mu.Lock()
	ch, ok := p.waiting[a.ID]
	delete(p.waiting, a.ID)
	p.mu.Unlock()
	if !ok {
		return http.StatusNotFound
	}
	ch <- body // buffered: never blocks
	return http.StatusOK
}

func (p *proxy) respond(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	raw = bytes.TrimSpace(raw)
	if len(raw) > 0 && raw[0] != '[' {
		var a answer
		if json.Unmarshal(raw, &a) != nil {
			reply(w, http.StatusBadRequest, `{"status":"error","error":"bad json"}`)
		} else if code := p.deliver(a); code == http.StatusOK {
			reply(w, code, `{"status":"ok"}`)
		} else if code == http.StatusNotFound {
			reply(w, code, `{"status":"error","error":"unknown id"}`)
		} else {
			reply(w, code, `{"status":"error","error":"need response or completion"}`)
		}
		return
	}
	var batch []answer
	if json.Unmarshal(raw, &batch) != nil {
		reply(w, http.StatusBadRequest, `{"status":"error","error":"bad json"}`)
		return
	}
	type result struct {
		ID     string `json:"id"`
		Status string `json:"status"`
		Code   int    `json:"code,omitempty"`
	}
	results := make([]result, len(batch))
	for i, a := range batch {
		results[i] = result{a.ID, "ok", 0}
		if code := p.deliver(a); code != http.StatusOK {
			results[i] = result{a.ID, "error", code}
		}
	}
	out, _ := json.Marshal(results)
	reply(w, http.StatusOK, string(out))
}

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/poll":
		p.poll(w, r)
	case r.Method == http.MethodPost && r.URL.Path == "/respond":
		p.respond(w, r)
	case r.Method == http.MethodPost:
		p.park(w, r)
	default:
		reply(w, http.StatusNotFound, `{"error":"not found"}`)
	}
}

func main() {
	port, err := 0, error(nil)
	if len(os.Args) == 2 {
		port, err = strconv.Atoi(os.Args[1])
	}
	if len(os.Args) != 2 || err != nil || port < 0 || port > 65535 {
		fmt.Fprintln(os.Stderr, "usage: go_proxy PORT")
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("ready") // os.Stdout is unbuffered in Go
	err = http.Serve(ln, &proxy{waiting: map[string]chan []byte{}})
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}
