"""The reference run (issue 13): the paper's Table 5 at SmolLM2 scale, trained to convergence on a GPU.

It sits on top of the stages, like the runner. The plan comes from a profile's ``reference`` section
(:mod:`.plan`); :mod:`.payload` carries the assets to a bare GPU machine (pack here, stage there); :mod:`.jobs`
runs one job per device command (train rows online, regenerate responses, evaluate on MT-bench) within its
minutes; :mod:`.outputs` keeps what a job brings back within the device's limits; :mod:`.merge` turns job
outputs into the run's tables, figures, committed checkpoints and regenerated data. The command line is
``scripts/reference/run_job.py``; README's "Reference run (GPU)" section lists the calls.

Import the submodules (``from kvshot_lib.reference import plan``): this file imports nothing, so that the
stage command on the device does not pay for torch and transformers.
"""
