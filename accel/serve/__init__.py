"""`accel serve`: the accelerated pipeline kept warm behind an OpenAI-style HTTP API.

`security` refuses a request at the door (Host, API key, body size), `requests` and `limits` check
what clients send, `replica` runs a request on the ranks of one replica,
`dispatch` queues requests for free replicas, `front` is the FastAPI app, `server` starts it all.
"""
