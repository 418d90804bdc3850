"""The reference run's transport to a bare, time-boxed remote GPU (optional; nothing in kvshot_lib imports it).

The run itself is :mod:`kvshot_lib.reference`. This package serves one kind of remote runner, whose limits shape
it: :mod:`.payload` packs the assets here in parts that fit one call and stages them there; :mod:`.jobs` runs one
job per command within its minutes (a clock, a calibration of each row's steps); :mod:`.outputs` keeps what a
job brings back within the runner's file limits (archives, split checkpoints); :mod:`.merge` turns returned
folders into the run's tables and figures (through :func:`kvshot_lib.reference.update_run`), checkpoints and
regenerated data; :mod:`.self_check` checks the remote machine's torch and transformers at stage time. The
command line is ``scripts/reference/run_job.py``.
"""
