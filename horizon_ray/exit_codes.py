"""Exit codes of ``horizon-ray finetune``: the job runner sets them, the node agent reports them and the
coordinator decides on them (docs/CONTRACTS.md)."""

DONE = 0
CRASHED = 1  # a traceback, then a one-line message
BAD_INPUT = 2  # a one-line message; nothing trained, or the job refused to start
# the job's lease moved on (a newer start of it took over its output directory, or it was cancelled or its node
# declared lost): this engine stopped and wrote nothing more (horizon_ray.job.lease)
FENCED = 3
# another runner holds the job's output directory (EX_TEMPFAIL): nothing was done; the coordinator
# places the job again a little later (an earlier engine of it may still be stopping)
OUTPUT_DIR_BUSY = 75
INTERRUPTED = 130  # Ctrl-C; resumable
TERMINATED = 143  # SIGTERM (128 + 15); resumable
