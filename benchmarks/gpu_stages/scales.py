"""What one run of the GPU check measures, and at which sizes: the :class:`Scale` of each ``--scale``, the drafters
it trains and those it replays at the paper's acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshot_lib.target import QWEN3_8B_CONFIG, REPO_ROOT, TINY_CONFIG

PARADIGMS = ("hidden", "kv", "hybrid")
TRAINING_ROWS = [(f"train_{p}-ttt", p, {}) for p in PARADIGMS] + [
    ("train_kv-ttt-norecency", "kv", dict(kv_recency=0))
]
QWEN3_VOCAB = QWEN3_8B_CONFIG["vocab_size"]
PAPER_TABLE5 = REPO_ROOT / "figures" / "onpolicy" / "data" / "paper_table5.csv"
# replayed acceptance: drafter -> (paradigm, layers, kv_mode, the paper's Table 5 row, Table 4's tree MAT or None)
REPLAYED = {
    "hidden": (
        "hidden",
        1,
        "concat",
        "EAGLE-3, 1 layer (hidden-only)",
        5.01,
    ),  # Table 4: EAGLE-3 from the checkpoint
    "kv-1L": ("kv", 1, "linear_rope", "KV 1L, projection + RoPE", None),
    "kv-2L": ("kv", 2, "linear_rope", "KV-only 2 layers", None),
    "kv-4L": ("kv", 4, "linear_rope", "KV-only 4 layers", None),
    "hybrid": (
        "hybrid",
        1,
        "linear_rope",
        "hybrid, from the EAGLE-3 checkpoint",
        5.04,
    ),  # Table 4: hybrid from it
}


@dataclass(frozen=True)
class Scale:
    """Shapes and sizes of one run of the check; ``qwen3-8b`` trains as the qwen3-8b profile does."""

    config: dict  # the target's architecture (the tokenizer gives the vocabulary)
    dtype: str  # the target's weights
    precision: str  # training and extraction ("bf16" on a GPU; "no": float32)
    max_len: int = 2048
    batch_size: int = 2
    draft_vocab_size: int = 32000
    train_steps: int = 30
    warm_steps: int = 2  # the first steps (allocation, kernel choice) are left out of tokens/s
    train_seconds: float = 12.0  # a cap per drafter, so the check fits its budget whatever the GPU
    budget_s: float = (
        330.0  # 6 minutes of an H100 lease, less start-up: a stage that would end later is skipped
    )
    extract_conversations: int = 8
    cv_context: int = 1024
    cv_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)
    cv_reps: int = 5
    prompts: int = 3  # MT-bench first turns, for plain decoding and greedy equality
    equality_prompts: int = 2  # of them, for greedy equality (bf16 and float32)
    decode_tokens: int = 128
    equality_tokens: int = 48
    chain_depth: int = 6
    tree: dict = field(default_factory=lambda: dict(tree_depth=7, tree_top_k=10, tree_budget=60))
    # replayed acceptance: the paper's chain of 7 steps (TTT's 7) and Table 4's tree (depth 8, top-10, 60 tokens)
    replay_tokens: int = 64
    replay_prompts: int = 2
    replay_chain_depth: int = 7
    replay_tree: dict = field(default_factory=lambda: dict(tree_depth=8, tree_top_k=10, tree_budget=60))
    replay_drafters: tuple[str, ...] = tuple(REPLAYED)
    # an untrained drafter's near-flat distributions give a bushy, shallow tree, where a trained one's is deep: its
    # LM head is scaled by this (the same cost) so that the best nodes form deep paths the drawn lengths can take
    replay_sharpen: float = 30.0
    compile_tokens: int = 64  # plain decoding with the target's norms and MLPs compiled, one prompt
    tie_fraction: float = (
        0.05  # a near-tie: plain decoding's top-2 logit gap under this share of the logits' std
    )
    # seconds each stage needs at this scale (a stage starts only if it can end within budget_s)
    needs: dict = field(
        default_factory=lambda: dict(
            plain_decoding=40, verification_cost=25, cycle_overhead=25, replayed_acceptance=45, greedy_equality=35,
            compiled_forward=60, greedy_equality_fp32=40, train=25, extraction=20,
        )
    )  # fmt: skip


SCALES = {
    # initializer_range 0.02 (Qwen3's own) gives near-flat logits: bf16 near-ties then decide most tokens, so the
    # check reports how far outputs agree before the first tie rather than widening a random model's logits
    "qwen3-8b": Scale(config=QWEN3_8B_CONFIG, dtype="bfloat16", precision="bf16"),
    # toy shapes for a CPU (the same code in seconds); wide weights keep greedy top-2 gaps far above float noise
    "tiny": Scale(
        config=dict(TINY_CONFIG, tie_word_embeddings=False, initializer_range=0.2),
        dtype="float32",
        precision="no",
        max_len=128,
        draft_vocab_size=512,
        train_steps=4,
        warm_steps=1,
        train_seconds=60.0,
        budget_s=600.0,
        extract_conversations=3,
        cv_context=64,
        cv_sizes=(1, 2, 4, 8),
        cv_reps=2,
        prompts=2,
        decode_tokens=12,
        equality_tokens=12,
        chain_depth=3,
        tree=dict(tree_depth=3, tree_top_k=2, tree_budget=6),
        replay_tokens=12,
        replay_prompts=1,
        replay_chain_depth=4,
        replay_tree=dict(tree_depth=4, tree_top_k=3, tree_budget=10),
        replay_drafters=("hidden", "kv-2L", "hybrid"),
        needs={},
    ),
}
