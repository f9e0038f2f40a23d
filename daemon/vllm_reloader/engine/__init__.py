"""One vLLM engine over HTTP: the client (`client`), the reload sequence (`swap`), and the
probe that decides whether new weights answer like a model (`canary`)."""
