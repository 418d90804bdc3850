"""The GPU check's parts (``benchmarks/gpu_check.py`` runs them, most important first), one module per concern:

- :mod:`.scales`: the sizes of a run (``--scale qwen3-8b`` or ``tiny``), the trained and the replayed drafters;
- :mod:`.bundle`: the few-MB folder a bare GPU machine reads instead of the asset wheels (``make gpu-bundle``);
- :mod:`.recording`: the machine and versions, and :func:`stage` (a stage's seconds, peak memory or error, saved
  after it);
- :mod:`.decoding_speed`: plain decoding, c_v(k), a speculative cycle's overhead and the compiled forward;
- :mod:`.replayed`: each paradigm's speed at the paper's acceptance;
- :mod:`.equality`: chain and tree speculative decoding against plain decoding, in the target's dtype and float32;
- :mod:`.training_speed`: online training and feature extraction tokens/s;
- :mod:`.report`: the JSON and its markdown table.
"""

from .bundle import bundle_assets, load_tokenizer, write_bundle
from .decoding_speed import compiled_forward, cycle_overhead, plain_decoding, verification_cost
from .equality import bound, float32_in_place, fresh_drafters, greedy_equality
from .recording import machine, preflight, stage, sync
from .replayed import paper_profiles, replay_drafters, replayed_acceptance
from .report import markdown, write_results
from .scales import QWEN3_VOCAB, REPLAYED, SCALES, TRAINING_ROWS, Scale
from .training_speed import measure_extraction, measure_training

__all__ = [
    "QWEN3_VOCAB",
    "REPLAYED",
    "SCALES",
    "TRAINING_ROWS",
    "Scale",
    "bound",
    "bundle_assets",
    "compiled_forward",
    "cycle_overhead",
    "float32_in_place",
    "fresh_drafters",
    "greedy_equality",
    "load_tokenizer",
    "machine",
    "markdown",
    "measure_extraction",
    "measure_training",
    "paper_profiles",
    "plain_decoding",
    "preflight",
    "replay_drafters",
    "replayed_acceptance",
    "stage",
    "sync",
    "verification_cost",
    "write_bundle",
    "write_results",
]
