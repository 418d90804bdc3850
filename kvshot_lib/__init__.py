"""KVShot: speculative decoding with drafters that reuse the target's hidden states, its KV cache, or both.

One package per stage, and data flows one way (a stage imports only earlier ones; ``tests/test_layout.py``):

    target -> corpus -> drafters -> training | decoding -> evaluation -> diagnostics | plots

``target`` loads the model and captures what it computes; ``corpus`` reads ShareGPT and MT-bench and keeps
feature stores; ``drafters`` holds every paradigm and the decode-time contract; ``training`` trains them;
``decoding`` is the lossless engine (plain, chain, tree) and SpecPV; ``evaluation`` measures acceptance by step,
speed and the metrics; ``diagnostics`` probes why KV reuse does (not) help; ``plots`` draws every figure from
saved tables. On top: ``runner`` (the notebooks under papermill), ``reference`` (the Table-5 reference run),
``cli`` (the ``kvshot`` command). Each package's ``__init__`` says what it does and exports its public names.
"""
