"""`accel batch`: many requests from a JSONL file through the served pipeline's replicas, into a
folder with a manifest; a rerun of the same command resumes.

items.py reads the file (one request per line, the API's fields); manifest.py keeps what was done
(outputs published whole, one manifest line per outcome); run.py drives the replicas from rank 0."""
