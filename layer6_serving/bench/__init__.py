"""Layer 6's tooling, apart from the server it measures: the `stack run/bench --layer 6`
commands (commands.py), the serving benchmark (serving.py: our server over HTTP against the
offline engine and a peer server), its workloads (dataset.py), the load generator
(loadgen.py: TTFT, TPOT, ITL, E2EL, goodput as `vllm bench serve` reports them), a server in
its own process (launch.py), the peer (peer.py: `transformers serve`) and the report
(report.py: tables and a plot).

Nothing in the server imports this package; it imports the server.
"""
