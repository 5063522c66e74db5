"""`python -m accel.cli`: how `accel` reruns itself on every rank of a job."""

from accel.cli import main

main()
