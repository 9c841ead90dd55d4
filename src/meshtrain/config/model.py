"""The ``[model]`` section: :class:`ModelConfig`, the shape of the decoder, and the names its
string options accept. :mod:`meshtrain.config` assembles it with the other sections; the checks
of its values are in :mod:`meshtrain.validation.model`."""

from __future__ import annotations

from dataclasses import dataclass, field

MLP_KINDS = ("swiglu", "gelu")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROPE_SCALING_KEYS: dict[str, dict[str, bool]] = {
    # rope_type -> {parameter: required}; the parameters as Hugging Face names them.
    "default": {},
    "linear": {"factor": True},
    "llama3": {"factor": True, "low_freq_factor": True, "high_freq_factor": True,
               "original_max_position_embeddings": True},
    "yarn": {"factor": True, "original_max_position_embeddings": True, "beta_fast": False,
             "beta_slow": False, "mscale": False, "mscale_all_dim": False,
             "attention_factor": False, "truncate": False},
}
MOE_BALANCE_KINDS = ("aux-loss", "bias", "none")
MOE_BALANCE_SCOPES = ("micro-batch", "sequence", "global-batch")
MOE_SCORE_KINDS = ("softmax", "sigmoid")

@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder (dense or Mixture-of-Experts)."""

    vocab_size: int = 0
    """Embedding rows. 0 = the tokenizer's vocabulary; a larger value pads it (e.g. for tp)."""
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 = n_heads (plain multi-head attention)."""
    head_width: int = 0
    """Width of each attention head (queries, keys, values); 0 = dim / n_heads. Qwen3 models use
    128 whatever their dim."""
    ffn_dim: int = 704
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    """RoPE frequency scaling as Hugging Face's ``rope_scaling`` defines it: empty (plain RoPE)
    or a table with ``rope_type`` (``linear``, ``llama3`` or ``yarn``; ``type`` is an alias) and
    that type's parameters (``factor``; llama3: ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``; yarn: ``original_max_position_embeddings`` and
    optionally ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
    ``attention_factor``, ``truncate``). See :mod:`meshtrain.model.rope`."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2 / Qwen2.5)."""
    wo_bias: bool = False
    """A bias on the attention output projection (Llama's ``attention_bias`` sets both)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (one weight of head_width shared by the heads)
    before RoPE (Qwen3)."""
    norm_eps: float = 1e-5
    moe_experts: int = 0
    """Routed experts per MoE layer; 0 = a dense model."""
    moe_top_k: int = 2
    moe_norm_topk: bool = True
    """Renormalise the chosen experts' gate weights to sum to 1 (Mixtral; Qwen-MoE's
    ``norm_topk_prob = true``). False keeps the raw scores of the chosen experts (Qwen-MoE's
    default). Softmax with ``moe_top_k = 1`` keeps the raw probability either way (Switch
    Transformer: a gate of 1 would give the router no gradient)."""
    moe_shared_experts: int = 0
    moe_shared_ffn_dim: int = 0
    """Hidden size of the shared experts together (one MLP); 0 = ``moe_shared_experts`` times
    the expert hidden size. Qwen2-MoE's ``shared_expert_intermediate_size``."""
    moe_shared_gate: bool = False
    """Scale the shared experts' output by ``sigmoid(x @ w)``, one learned gate per token
    (``moe.shared_gate``, a [1, dim] weight; Qwen2-MoE's ``shared_expert_gate``). Needs
    ``moe_shared_experts > 0``."""
    moe_capacity_factor: float = 0.0
    """Tokens an expert accepts, as a multiple of its fair share of a routing group; 0 =
    dropless."""
    moe_capacity_group: int = 0
    """Tokens of one routing group, over which capacity is decided: that many consecutive
    positions of one sequence (0 = the whole sequence, ``train.seq_len``). Must divide
    ``train.seq_len`` (under context parallelism ``seq_len / (2 cp)``), so every layout sees the
    same groups and drops the same assignments."""
    moe_balance: str = "aux-loss"
    moe_balance_scope: str = "micro-batch"
    """Over which tokens the auxiliary loss's expert load fractions and mean probabilities are
    taken: ``micro-batch`` (each forward's tokens), ``sequence`` (each sequence, averaged over
    sequences) or ``global-batch`` (the load of every micro-batch and data- / context-parallel
    rank of the step; the only scope whose numbers do not depend on how the batch is split).
    The bias update of ``moe_balance = "bias"`` always uses the global batch's load; see
    docs/parallelism.md, "MoE balance scopes"."""
    moe_aux_coef: float = 0.01
    moe_bias_rate: float = 0.001
    """Step size of the auxiliary-loss-free bias update (``moe_balance = "bias"``)."""
    moe_score: str = "softmax"
    moe_every: int = 1
    """Every k-th block (counting from block k-1) is an MoE block; the rest are dense."""
    moe_first_dense: int = 0
    """The first k blocks are dense whatever ``moe_every`` says (DeepSeek-V3's
    ``first_k_dense_replace``)."""
    moe_groups: int = 0
    """Expert groups for node-limited routing: the experts, in id order, form this many equal
    groups (0 = no groups). With ``parallel.ep`` equal to it, a group is one ep rank's experts."""
    moe_max_groups: int = 0
    """Node-limited routing (DeepSeek-V3): each token picks its experts from at most this many
    of the ``moe_groups`` groups, those with the largest sum of their two best (biased)
    scores; 0 = every group."""
    moe_ffn_dim: int = 0
    """Hidden size of each expert; 0 = ffn_dim."""

    @property
    def head_dim(self) -> int:
        """Per-head width: head_width, or dim / n_heads when 0."""
        return self.head_width or self.dim // self.n_heads

    @property
    def rope_type(self) -> str:
        """The RoPE variant of ``rope_scaling``: ``default`` when it is empty."""
        scaling = self.rope_scaling or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    @property
    def kv_heads(self) -> int:
        """Effective key/value head count (n_kv_heads, or n_heads when 0)."""
        return self.n_kv_heads or self.n_heads

    @property
    def expert_ffn_dim(self) -> int:
        """Effective hidden size of one expert."""
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def shared_ffn_dim(self) -> int:
        """Effective hidden size of the shared experts' MLP (0 without shared experts)."""
        if not self.moe_shared_experts:
            return 0
        return self.moe_shared_ffn_dim or self.expert_ffn_dim * self.moe_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) holds an MoE feed-forward instead of a dense one."""
        return (self.moe_experts > 0 and layer >= self.moe_first_dense
                and (layer + 1) % self.moe_every == 0)

    def moe_layer_count(self, layers) -> int:
        """How many of the block indices ``layers`` hold an MoE feed-forward (at once for a
        dense model: the planner asks for every stage of every layout it prices)."""
        if not self.moe_experts:
            return 0
        return sum(1 for layer in layers if self.is_moe_layer(layer))

    @property
    def first_moe_layer(self) -> int:
        """The first MoE block's index (-1 for a dense model)."""
        if not self.moe_experts:  # the planner asks per stage of every layout it prices
            return -1
        return next((i for i in range(self.n_layers) if self.is_moe_layer(i)), -1)
