"""Stand-ins and data shared by the benchmarks and the tests: a Kubernetes API server, Daytona's API and
daemon, Modal's sandbox
and task command router, and synthetic viewer runs. They import nothing of ``tests``."""
