"""The planner's model of one training step (``hpc plan``): time and memory of a (dp, tp, pp) layout, on paper.

Pure functions of frozen dataclasses, standard library only: no processes, no torch. Every equation is written out,
with its source, in docs/PLANNER.md; the names below follow it:

- compute from FLOPs: a transformer layer's forward is 24 b s h^2 + 4 b s^2 h (Narayanan et al. SC21, section
  5.1), the logits 2 b s h V; backward twice the forward; activation checkpointing recomputes the layers' forward
  (full), or all of it but the matrix products and attention, whose outputs it keeps (selective: torchtitan's op-level
  selective checkpointing, jobs/train/parallelize.py), only their elementwise work done again.
  In general 2 b s FLOPs per matrix parameter (grouped-query attention's K and V have k/a of Q's; a gated MLP
  three h x ffn matrices) and 4 b s s' h for the scores and weighted values, s' = s or the sliding window.
  Matrix products run at ``matmul_efficiency`` of the device's peak; the elementwise work (layer norms, softmax,
  dropout, GeLU) is bound by memory bandwidth, moving the bytes of the layer's activations (Korthikanti et al.,
  MLSys 2023, eq. 1: s b h (10 + 24/t + 5 a s / (h t))).
- tensor parallelism: two all-reduces of b s h activations per layer in forward, two in backward, two more when
  recomputing (Shoeybi et al. 2019, figure 4), and the vocabulary-split embedding's, head's and loss's; a ring
  all-reduce of n bytes over k ranks takes 2 (k-1) alpha + 2 (k-1)/k n / beta (Thakur et al. 2005; Patarasuk
  and Yuan 2009).
- pipeline parallelism: m microbatch slots of the last stage (it holds the head: the slowest) and a bubble of
  (p-1)/v slots of the other stages, which fill and drain the pipeline (GPipe and 1F1B: v = 1; Narayanan et al.
  SC21 section 2.2), and a point-to-point send of b s h / t bytes forward and backward per microbatch and model
  chunk (the scatter/gather optimization, ibid. section 4.1; b s h for our pipeline); a tied embedding's gradient
  all-reduced between the first and the last stage after backward (Megatron's embedding group; parallel/tied.py).
- data parallelism: a ring all-reduce of the stage's gradients (ZeRO-3: 1.5 times that volume, Rajbhandari et
  al. SC20), times the codec's wire ratio; with overlap it hides behind the last microbatch's backward, bucket
  by bucket: the last bucket is ready only when backward ends, so its share is never hidden (one bucket: none is).
- mixture of experts (jobs/models/moe.py, parallel/ep.py): E experts in every moe_every-th layer's MLP, top_k of them
  per token (Fedus et al. 2022; Lepikhin et al. 2021): top_k - 1 more MLPs of compute per token and a router;
  each rank holds E/ep experts; four all-to-alls per MoE layer and microbatch, of top_k copies of its tokens,
  (k-1) alpha + (k-1)/k n / beta each; expert gradients reduced over the dp/ep replicas.
- gradient accumulation: each microbatch after the first adds its weight gradients to the stage's, three
  gradient-sized moves per parameter (torch's AccumulateGrad, Megatron-LM's main_grad): pipelines with many small
  microbatches pay it m - 1 times a step.
- memory per rank: parameters, gradients and optimizer state per parameter (ZeRO's 2 + 2 + 12 bytes for mixed
  precision Adam, each sharded over dp from stage 3, 2 and 1), and activations of the microbatches in flight
  (GPipe m, 1F1B min(m, p), interleaved p + (p-1)/v): a layer's Korthikanti count, under full checkpointing its
  input, under selective its input and the products' outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from parallel.cluster import Cluster, Dtype
from parallel.compression.wire import wire_ratio

if TYPE_CHECKING:
    from hpc.config import JobSpec

Schedule = Literal["gpipe", "1f1b", "interleaved"]
Recompute = Literal["", "selective", "full"]  # activation checkpointing: none, selective (products kept), full
Family = Literal["gpt", "llama"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved")
RECOMPUTES: tuple[Recompute, ...] = ("", "selective", "full")
GIB = 1 << 30


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer: layers of attention (heads split over tp) and an MLP, embeddings, logits.

    The defaults are Megatron-LM's GPT: a 4h MLP, a bias on every linear, LayerNorms, learned positions and the
    head tied to the embedding. ``family="llama"`` is the shape transformers' Llama, Mistral and Qwen models share:
    RMSNorm weights (the final one counted too), rotary positions (no parameters), no biases but ``layer_biases``;
    with ``kv_heads`` (grouped-query attention), ``gated`` (SwiGLU) and ``ffn``. ``counted``: a model the planner
    counted on the meta device instead (``hpc plan`` of a ``model.entry``)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    experts: int = 0  # a mixture of experts in every moe_every-th layer's MLP (jobs/models/moe.py); 0: dense
    top_k: int = 1  # experts per token
    moe_every: int = 1
    kv_heads: int = 0  # grouped-query attention: the heads of K and V (0: as many as Q's)
    head_dim: int = 0  # 0: hidden / heads
    ffn: int = 0  # the MLP's intermediate size (0: 4 hidden)
    gated: bool = False  # three hidden x ffn matrices (gate, up, down) instead of two
    tied: bool = True  # the head's weight is the embedding's: counted once (the logits are computed all the same)
    window: int = 0  # sliding-window attention: at most this many keys per query (0: the whole sequence)
    window_layers: int = 0  # how many layers have the window, the others attend to the whole sequence (0: all)
    family: Family = "gpt"
    layer_biases: int = 0  # llama: a layer's parameters beyond its matrices and norms (Qwen2's q, k, v biases)
    counted: tuple[int, ...] = ()  # counted on the meta device: (first part, one block, last part) parameters
    shared: int = 0  # counted: parameters the first and last parts share (tied embeddings)
    name: str = "GPT"

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def intermediate(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.experts else 0

    @property
    def layer_matrices(self) -> int:
        """A layer's matrix parameters, 2 FLOPs per token each: Q and the output projection (h a d each), K and V
        (h k d each: fewer with grouped-query attention), the MLP's 2 (3 gated) h x ffn; 12 h^2 for Megatron's."""
        if self.counted:
            return self.counted[1]
        h, mlp = self.hidden, (3 if self.gated else 2) * self.hidden * self.intermediate
        return h * (2 * self.heads + 2 * self.kv) * self.dim + mlp

    @property
    def expert_params(self) -> int:
        """One MLP (an expert of an MoE layer): its matrices and, in the GPT, their biases: 8 h^2 + 5 h for 4h."""
        matrices = (3 if self.gated else 2) * self.hidden * self.intermediate
        biases = (2 if self.gated else 1) * self.intermediate + self.hidden
        return matrices + (biases if self.family == "gpt" else 0)

    @property
    def layer_params(self) -> int:
        """GPT: the matrices, a bias on each (QKV's, the projection's, the MLP's) and two LayerNorms, 12 h^2 + 13 h
        for Megatron's; llama: the matrices, two RMSNorm weights and ``layer_biases``."""
        h = self.hidden
        if self.counted:
            return self.counted[1]
        if self.family == "llama":
            return self.layer_matrices + 2 * h + self.layer_biases
        qkv = (self.heads + 2 * self.kv) * self.dim
        return self.layer_matrices + qkv + h + (2 if self.gated else 1) * self.intermediate + h + 4 * h

    @property
    def positions(self) -> int:
        """Learned position embeddings' parameters (the GPT's); rotary ones have none."""
        return self.seq_len * self.hidden if self.family == "gpt" and not self.counted else 0

    @property
    def final_norm(self) -> int:
        """The final norm's parameters as ``params`` counts them: an RMSNorm's h; none for the GPT, as in
        Megatron's formula (its pipeline's last stage holds the LayerNorm's 2 h: ``stage_params``)."""
        return self.hidden if self.family == "llama" and not self.counted else 0

    @property
    def attended(self) -> float:
        """Keys a query attends to, averaged over the layers: s, or the window on the layers that have one."""
        if not self.window or self.window >= self.seq_len:
            return self.seq_len
        sliding = self.window_layers or self.layers
        return (sliding * self.window + (self.layers - sliding) * self.seq_len) / self.layers

    @property
    def params(self) -> int:
        """12 l h^2 + 13 l h + (V + s) h (Narayanan et al. SC21, section 5.1) for Megatron's GPT; in general the
        layers, the embedding (and the head's own weight when untied), the positions and the final norm; an MoE
        layer has E experts for its one MLP, and a router of h E."""
        h = self.hidden
        if self.counted:
            return self.counted[0] + self.layers * self.counted[1] + self.counted[2] - self.shared
        ends = self.vocab * h * (1 if self.tied else 2) + self.positions + self.final_norm
        return self.layers * self.layer_params + ends + \
            self.moe_layers * ((self.experts - 1) * self.expert_params + h * self.experts)

    def moe_extra_flops(self, tokens: int) -> float:
        """What an MoE layer's forward adds to a dense one's: top_k - 1 more MLPs per token (16 b s h^2 each for
        4h) and the router's 2 b s h E (capacity only drops tokens, so it is left out)."""
        mlp = (3 if self.gated else 2) * self.hidden * self.intermediate
        return 2.0 * tokens * mlp * (self.top_k - 1) + 2.0 * tokens * self.hidden * self.experts

    def layer_flops(self, tokens: int) -> float:
        """One layer's forward over ``tokens`` = b s tokens: 2 b s per matrix parameter, and 4 b s s' a d for the
        scores and the weighted values, s' the keys a query attends to: 24 b s h^2 + 4 b s^2 h for the GPT."""
        return 2.0 * tokens * self.layer_matrices + 4.0 * tokens * self.attended * self.heads * self.dim

    def logit_flops(self, tokens: int) -> float:
        """The logits' forward: 2 b s h V."""
        return 2.0 * tokens * self.hidden * self.vocab

    def activation_bytes(self, tokens: int, tp: int, act_bytes: int, scores: bool = True) -> float:
        """Bytes one layer keeps for backward: s b h (10 + 24/t + 5 a s / (h t)) with 16-bit activations
        (Korthikanti et al., eq. 1 and section 4.1), scaled for 4-byte ones. Of the 24: Q, K, V and the output
        projection's input 8 (4 (a + k) d / h with k KV heads), the MLP's 16 (4 ffn / h: its first layer's output
        and the activation's; gated, 8 ffn / h: the gate's and up's outputs, the activation's and the product).
        ``scores=False``: a fused attention kernel (SDPA, flash) keeps no a s^2 scores, only its output's
        statistics: the 5 a s / (h t) term goes."""
        h, a, s = self.hidden, self.heads, self.attended
        split = (4 * (a + self.kv) * self.dim + (8 if self.gated else 4) * self.intermediate) / h
        return tokens * h * (10 + split / tp + scores * 5 * a * s / (h * tp)) * act_bytes / 2

    def product_bytes(self, tokens: int, tp: int, act_bytes: int) -> float:
        """Bytes selective checkpointing keeps of one layer: its input (the checkpoint's) and what its matrix
        products and attention output: Q, K and V ((a + 2k) d / t), attention's output (a d / t), the MLP's first
        products (ffn / t, gated 2 ffn / t) and the two row-parallel products (h each: every TP rank holds its
        partial sum whole, before the all-reduce)."""
        h = self.hidden
        split = ((2 * self.heads + 2 * self.kv) * self.dim + (2 if self.gated else 1) * self.intermediate) / tp
        return tokens * (3 * h + split) * act_bytes


@dataclass(frozen=True)
class Training:
    """What the step does besides the model: the global batch, the arithmetic and the bytes per parameter."""

    batch: int  # sequences per step, all replicas together
    dtype: Dtype = "bf16"  # of the matrix products
    act_bytes: int = 2  # per activation element (sent by TP and PP, kept for backward)
    param_bytes: int = 2  # the weights the matrix products use
    grad_bytes: int = 2  # per gradient element (what the DP all-reduce sends before the codec)
    optimizer_bytes: int = 12  # fp32 master weights and Adam's two moments
    wire_ratio: float = 1.0  # the codec's bytes on the wire over grad_bytes
    codec: str = "none"  # parallel.compression: what CPU ranks spend encoding (int8: Cluster.int8_encode_ns)
    compression_scope: str = "auto"  # flat | inter-node | auto: the faster of the two (parallel/hierarchy.py)
    fused_attention: bool = False  # SDPA / flash attention: no scores kept (our models; Megatron-LM of SC21 kept them)
    compiled: bool = True  # elementwise work fused into kernels (Megatron-LM's; ours under train.compile), else eager
    dp_overlap: bool = True  # DP communication runs behind backward (parallel/optimizer.py)
    bucket_bytes: float = 25 * 2**20  # gradients fused per all-reduce (parallel.bucket_mb; DDP's default too)
    # Megatron-LM's scatter/gather: each of a stage's tp ranks sends 1/tp of the activation (ibid. section 4.1);
    # our pipeline (parallel/pipeline.py) sends the whole of it from every tp rank.
    p2p_split_over_tp: bool = True
    fused_head_loss: bool = False  # train.fused_head_loss: the logits made a chunk at a time, never whole


FUSED_LOSS_CHUNK_BYTES = 4 * (1 << 26)  # parallel.tensor_parallel.LOSS_CHUNK_ELEMENTS in float32 (torch-free here)
FUSED_LOSS_KEPT_SHARE = 4  # parallel.tensor_parallel.KEPT_ROWS_SHARE
MIXED_ADAM = Training(batch=1)  # Megatron-LM and ZeRO: fp16/bf16 weights and gradients, fp32 Adam state
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "lars": 4}  # state per parameter: moments, momentum


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    microbatches: int  # per step and replica
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    checkpointing: Recompute = ""
    zero: int = 0
    ep: int = 1  # expert parallelism: each MoE layer's experts spread over ep ranks of the dp group
    scope: str = "flat"  # of the DP gradient exchange; estimate() sets the one it predicts

    def label(self) -> str:
        sched = f"interleaved/{self.virtual_stages}" if self.schedule == "interleaved" else self.schedule
        zero = f" z{self.zero}" if self.zero else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        scope = " inter-node" if self.scope == "inter-node" else ""
        ckpt = {"": "", "selective": " sac", "full": " ckpt"}[self.checkpointing]
        return f"dp={self.dp} tp={self.tp} pp={self.pp} m={self.microbatches} {sched}{ckpt}{zero}{ep}{scope}"

    @property
    def flop_passes(self) -> int:
        """Passes of the layers' matrix products: forward, backward (two forwards' worth), and under full
        checkpointing the recomputed forward; selective keeps the products."""
        return 4 if self.checkpointing == "full" else 3

    @property
    def elementwise_passes(self) -> int:
        """Passes of the layers' elementwise work: either checkpointing redoes it in backward."""
        return 4 if self.checkpointing else 3


@dataclass(frozen=True)
class Estimate:
    """One layout's predicted step: seconds by part (they sum to step_s), memory, rates."""

    layout: Layout
    step_s: float
    compute_s: float
    tp_s: float
    pp_s: float  # the bubble, the point-to-point sends and a tied embedding's gradient all-reduce
    dp_s: float  # exposed (not hidden behind backward)
    ep_s: float  # the MoE layers' all-to-alls (dispatch and combine, forward and backward)
    optimizer_s: float
    overhead_s: float  # the step's fixed cost and its one-number all-reduces
    memory_bytes: float
    tokens_per_s: float
    tflops_per_gpu: float  # FLOPs executed (recomputation included), per GPU and second
    mfu: float  # model FLOPs (no recomputation) over the peak of every GPU

    def shares(self) -> dict[str, float]:
        parts = {"compute": self.compute_s, "tp": self.tp_s, "pp": self.pp_s, "dp": self.dp_s, "ep": self.ep_s,
                 "optimizer": self.optimizer_s, "overhead": self.overhead_s}
        return {name: value / self.step_s for name, value in parts.items()}


def ring_allreduce_s(nbytes: float, ranks: int, link: tuple[float, float]) -> float:
    """2 (k-1) alpha + 2 (k-1)/k n / beta: a ring's reduce-scatter then all-gather."""
    alpha, beta = link
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes / beta


def all_to_all_s(nbytes: float, ranks: int, link: tuple[float, float]) -> float:
    """(k-1) alpha + (k-1)/k n / beta: every rank sends each of the k-1 others its share of n bytes."""
    alpha, beta = link
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * alpha + (ranks - 1) / ranks * nbytes / beta


def microbatch_all_to_all_s(model: Transformer, train: Training, cluster: Cluster, lay: Layout) -> float:
    """The MoE layers of a stage, one microbatch: each dispatches its top_k copies of every token to the experts'
    ranks and combines them back, in forward, and both again in backward (parallel/ep.py): four all-to-alls."""
    tokens = train.batch // (lay.dp * lay.microbatches) * model.seq_len
    sent = tokens * model.top_k * model.hidden * train.act_bytes / lay.tp
    return model.moe_layers / lay.pp * 4 * all_to_all_s(sent, lay.ep, cluster.link(lay.dp * lay.tp))


def kept_bytes(model: Transformer, train: Training, cluster: Cluster, tokens: int, tp: int) -> float:
    """What one layer keeps for backward in this training: Korthikanti's count, without the scores under a fused
    attention kernel, times the cluster's ``eager_kept`` in eager PyTorch."""
    kept = model.activation_bytes(tokens, tp, train.act_bytes, scores=not train.fused_attention)
    return kept * (1 if train.compiled else cluster.eager_kept)


def microbatch_parts(model: Transformer, train: Training, cluster: Cluster, lay: Layout,
                     head: bool = True) -> tuple[float, float, float]:
    """(compute, TP, point-to-point) seconds of one microbatch on the last stage, all its chunks: the slowest, as it
    holds the head and the loss; ``head=False``: on a stage without them, what the pipeline's bubble is made of."""
    tokens = train.batch // (lay.dp * lay.microbatches) * model.seq_len
    layers = model.layers / lay.pp
    rate = cluster.peak_flops(train.dtype) * cluster.matmul_efficiency
    moe = model.moe_layers / lay.pp * model.moe_extra_flops(tokens)
    flops = lay.flop_passes * (layers * model.layer_flops(tokens) + moe) + 3 * head * model.logit_flops(tokens)
    matmul = flops / lay.tp / rate
    # Elementwise work: forward writes the kept activations, backward reads them and writes as much again; either
    # recomputation writes them once more.
    moved = (lay.elementwise_passes - 1) * layers * model.activation_bytes(tokens, lay.tp, train.act_bytes,
                                                                         not train.fused_attention)
    moved *= 1 if train.compiled else cluster.eager_traffic  # unfused: each op reads and writes its tensors again
    # Gradient accumulation: every microbatch after the first adds its weight gradients to the stage's (torch's
    # AccumulateGrad; Megatron-LM's main_grad.add_), reading both and writing the sum: (m-1)/m adds per microbatch.
    moved += (1 - 1 / lay.microbatches) * stage_params(model, lay) * 3 * train.grad_bytes
    # Fixed cost per layer pass (CPU ranks: the interpreter and dispatcher), the head's counted as one layer's.
    fixed = (lay.elementwise_passes / 3 * layers + head) * cluster.layer_overhead_us * 1e-6
    ranks = lay.dp * lay.tp * lay.pp
    compute = (matmul + moved / (cluster.memory_gbps * 1e9)) / cluster.core_share(ranks)
    compute += fixed / cluster.interpreter_share(ranks)
    message = tokens * model.hidden * train.act_bytes
    allreduces = layers * (6 if lay.checkpointing else 4)  # either checkpointing redoes the forward's two
    # The vocabulary-split head: its input's gradient, and the loss's three numbers per token (max, target logit,
    # sum of exponentials, fp32); the vocabulary-split embedding's lookup is on the first stage (here when pp = 1).
    allreduces += head * (1 + (lay.pp == 1))
    link = cluster.link(lay.tp)
    tp = allreduces * ring_allreduce_s(message, lay.tp, link) + 3 * head * ring_allreduce_s(4 * tokens, lay.tp, link)
    p2p = 0.0
    if lay.pp > 1:
        alpha, beta = cluster.link(ranks)
        split = lay.tp if train.p2p_split_over_tp else 1
        p2p = 2 * lay.virtual_stages * (alpha + message / split / beta)
    return compute, tp, p2p


def dp_ranks_per_node(cluster: Cluster, lay: Layout) -> int:
    """How many ranks of a DP group share a node: its ranks are tp apart (hpc/runtime/mesh.py)."""
    return min(lay.dp, max(1, cluster.devices_per_node // lay.tp))


def gradient_exchange_s(n: float, train: Training, cluster: Cluster, lay: Layout) -> tuple[float, str]:
    """(seconds, scope) of the DP group's exchange of ``n`` gradients: the flat ring, the codec on every hop (ZeRO-2
    and 3: its reduce-scatter alone), or cut by node (parallel/hierarchy.py): an uncompressed reduce-scatter and
    all-gather inside the node, the codec across the nodes on 1/g of the bytes, the g rings in parallel, each on
    its own link (ZeRO-2 and 3: the two reduce-scatters alone); with the codec's own work (:func:`codec_cpu_s`).
    ``train.compression_scope`` auto, with a codec: the faster (a run's auto cuts by node wherever a codec crosses
    nodes: hpc plan says where that pays)."""
    flat = ring_allreduce_s(n * train.grad_bytes * train.wire_ratio, lay.dp, cluster.link(lay.dp * lay.tp))
    flat = flat / (2 if lay.zero >= 2 else 1) + codec_cpu_s(n, train, cluster, lay, "flat")
    g = dp_ranks_per_node(cluster, lay)
    scope = train.compression_scope
    if scope == "flat" or g >= lay.dp or (scope == "auto" and train.wire_ratio >= 1):  # auto: a codec's, as a run's
        return flat, "flat"
    inside = ring_allreduce_s(n * train.grad_bytes, g, cluster.link(g * lay.tp))
    across = ring_allreduce_s(n * train.grad_bytes * train.wire_ratio / g, lay.dp // g, cluster.link(lay.dp * lay.tp))
    cut = (inside + across) / (2 if lay.zero >= 2 else 1)  # ZeRO-2/3: both stages reduce-scatters, no gathers
    cut += codec_cpu_s(n, train, cluster, lay, "inter-node")
    return (cut, "inter-node") if train.compression_scope == "inter-node" or cut < flat else (flat, "flat")


def codec_cpu_s(n: float, train: Training, cluster: Cluster, lay: Layout, scope: str) -> float:
    """One CPU rank's int8 work in the DP exchange of ``n`` gradients (parallel/ring.py): each element encoded once
    with its error feedback on its way round the ring of k ranks and 2 (k-1)/k hops' decodes and adds (ZeRO-2 and 3,
    the reduce-scatter alone: (k-1)/k of each); cut by node, on the node's 1/g across the nodes' ring. It runs on
    the cores the ranks compute on, so it never hides behind backward. Zero on GPUs (Cluster.int8_encode_ns 0: the
    codec's kernels run beside the link) and for the other codecs (a cast costs a copy; not counted)."""
    g = dp_ranks_per_node(cluster, lay) if scope == "inter-node" else 1
    k = lay.dp // g
    if train.codec != "int8" or k <= 1 or not cluster.int8_encode_ns:
        return 0.0
    share = (k - 1) / k
    encodes, hops = (share, share) if lay.zero >= 2 else (1.0, 2 * share)
    per_element_s = (encodes * cluster.int8_encode_ns + hops * cluster.int8_hop_ns) * 1e-9
    return n / g * per_element_s / cluster.core_share(lay.dp * lay.tp * lay.pp)


def dp_comm_s(model: Transformer, train: Training, cluster: Cluster, lay: Layout) -> tuple[float, float]:
    """(seconds that may run behind backward, seconds that cannot) of the DP group's traffic by ZeRO stage
    (parallel/zero.py): 0 and 1 all-reduce the gradients, 2 and 3 reduce-scatter them (half the ring's volume);
    1 and 2 then all-gather the updated parameters (each owner broadcasts its share), 3 gathers them before the
    forward and again before the backward (Rajbhandari et al. SC20: 1.5 x the all-reduce's volume). Experts go
    over their dp/ep replicas only (parallel/ep.py), the rest over dp; a CPU rank's codec work cannot hide."""
    experts = stage_expert_params(model, lay)
    dense, link = stage_params(model, lay) - experts, cluster.link(lay.dp * lay.tp)
    parts = [(dense, lay.dp), *([(experts, lay.dp // lay.ep)] if experts else [])]  # experts: over their replicas
    reduce, scope = gradient_exchange_s(dense, train, cluster, lay)  # experts: parallel/ep.py, over their replicas
    codec = codec_cpu_s(dense, train, cluster, lay, scope)
    reduce += ring_allreduce_s(experts * train.grad_bytes * train.wire_ratio, lay.dp // lay.ep, link) / (
        2 if lay.zero >= 2 else 1)
    gather = sum(ring_allreduce_s(n * train.param_bytes, ranks, link) / 2 for n, ranks in parts)
    return reduce - codec, codec + (0.0 if lay.zero == 0 else gather * (2 if lay.zero == 3 else 1))


def tied_embedding_s(model: Transformer, train: Training, cluster: Cluster, lay: Layout) -> float:
    """A tied embedding under pp > 1 (parallel/tied.py, Megatron's embedding group): after the DP exchange and before
    clipping, the first and the last stage of each pipeline all-reduce the tensor's gradient (its share over tp),
    across the whole job's span; nothing hides it. Zero on one stage or with an untied head."""
    shared = model.shared if model.counted else model.vocab * model.hidden * model.tied
    if lay.pp == 1 or not shared:
        return 0.0
    return ring_allreduce_s(shared / lay.tp * train.grad_bytes, 2, cluster.link(lay.dp * lay.tp * lay.pp))


def stage_tensors(model: Transformer, lay: Layout) -> float:
    """Parameter tensors on the rank holding the most (what the optimizer's per-tensor cost counts): the GPT's 11 per
    block (two layer norms, QKV, two projections, the MLP's two layers), the embedding's 2 and the head's 3; a Llama's
    9 (two norms, Q, K, V, O, three MLP matrices) and 3 biases, the embedding's 1 and the head's 2 (norm and
    weight)."""
    if model.family == "llama":
        block = 6 + (3 if model.gated else 2) + (3 if model.layer_biases else 0)
        return model.layers / lay.pp * block + (3 - model.tied if lay.pp == 1 else 2)
    block = 11 + (2 if model.gated else 0)
    return model.layers / lay.pp * block + (5 if lay.pp == 1 else 3)


def stage_params(model: Transformer, lay: Layout) -> float:
    """Parameters on the rank holding the most: a stage's layers over tp, and the embedding (first stage; the last
    holds the tied copy, or its own head, for the logits, and the final norm); an MoE layer adds its router and its
    E/ep experts past the first. A model counted on the meta device: its first and last parts' parameters over tp."""
    h = model.hidden
    layers = model.layers / lay.pp * model.layer_params / lay.tp
    moe = model.moe_layers / lay.pp * (h * model.experts - model.expert_params) / lay.tp  # router for the dense MLP
    if model.counted:
        first, _, last = model.counted
        return layers + (first + last - model.shared if lay.pp == 1 else last) / lay.tp
    if lay.pp == 1:  # besides the embedding: the untied head, learned positions, the final norm
        rest = (0 if model.tied else model.vocab * h / lay.tp) + model.positions + model.final_norm
    else:  # the last stage: the head (the tied copy, or its own) and the final norm
        rest = model.final_norm or 2 * h
    return layers + model.vocab * h / lay.tp + rest + moe + stage_expert_params(model, lay)


def stage_expert_params(model: Transformer, lay: Layout) -> float:
    """A stage's expert parameters on one rank: E/ep experts per MoE layer, over tp."""
    return model.moe_layers / lay.pp * model.experts / lay.ep * model.expert_params / lay.tp


def memory_bytes(model: Transformer, train: Training, cluster: Cluster, lay: Layout) -> float:
    """Peak bytes of one rank: model states (ZeRO-sharded by stage) and the activations in flight."""
    params = stage_params(model, lay)
    states = params * (train.param_bytes / (lay.dp if lay.zero >= 3 else 1)
                       + train.grad_bytes / (lay.dp if lay.zero >= 2 else 1)
                       + train.optimizer_bytes / (lay.dp if lay.zero >= 1 else 1))
    tokens = train.batch // (lay.dp * lay.microbatches) * model.seq_len
    layer = kept_bytes(model, train, cluster, tokens, lay.tp)
    kept = {"": layer, "selective": model.product_bytes(tokens, lay.tp, train.act_bytes),  # per layer, microbatch
            "full": tokens * model.hidden * train.act_bytes}[lay.checkpointing]
    p, m, v = lay.pp, lay.microbatches, lay.virtual_stages
    in_flight = {"gpipe": m, "1f1b": min(m, p), "interleaved": min(m, p + (p - 1) / v)}[lay.schedule]
    if lay.checkpointing != "full":  # an MoE layer keeps top_k - 1 more MLPs' activations (19 s b h of Korthikanti's
        # 34; selective: their products, as product_bytes counts them) and its router's fp32 output
        mlp = {"": 19 * model.hidden * train.act_bytes / 2 / lay.tp,
               "selective": ((2 if model.gated else 1) * model.intermediate / lay.tp + model.hidden) * train.act_bytes,
               }[lay.checkpointing]
        kept += model.moe_layers / model.layers * tokens * (mlp * (model.top_k - 1) + 4 * model.experts)
    activations = model.layers / p * in_flight * kept + (layer if lay.checkpointing else 0.0)
    logits = 4.0 * tokens * model.vocab / lay.tp  # fp32 logits of the microbatch for the loss
    if train.fused_head_loss:  # one chunk of them at a time, and the gradients of a group of chunks' logits kept
        kept_rows = min(model.hidden, tokens / FUSED_LOSS_KEPT_SHARE)  # for one weight-gradient product
        logits = min(logits, FUSED_LOSS_CHUNK_BYTES) + kept_rows * model.vocab / lay.tp * train.act_bytes
    return cluster.rank_base_mib * (1 << 20) + states + activations + logits + node_segment_bytes(model, train,
                                                                                                 cluster, lay)


def node_segment_bytes(model: Transformer, train: Training, cluster: Cluster, lay: Layout) -> float:
    """The exchange cut by node on CPU ranks (``cores_per_node`` set) keeps two sets of segments of the largest bucket
    in the node's shared memory (parallel/node_memory.py); a rank writes its own whole and reads two chunks of each
    other's, 2 x bucket x (1 + 2 (g-1)/g) of its resident memory. None on GPUs (NCCL's own stages)."""
    g = dp_ranks_per_node(cluster, lay)
    dense = stage_params(model, lay) - stage_expert_params(model, lay)
    if not cluster.cores_per_node or g <= 1 or gradient_exchange_s(dense, train, cluster, lay)[1] != "inter-node":
        return 0.0
    return 2 * min(train.bucket_bytes, dense * train.grad_bytes) * (1 + 2 * (g - 1) / g)


def estimate(model: Transformer, train: Training, cluster: Cluster, lay: Layout) -> Estimate:
    """The predicted step of ``lay``: pipeline slots, exposed DP communication and the optimizer's update."""
    compute, tp, p2p = microbatch_parts(model, train, cluster, lay)
    a2a = microbatch_all_to_all_s(model, train, cluster, lay)
    slot = compute + tp + p2p + a2a
    bubble = 0.0
    if lay.pp > 1:  # the other stages filling and draining the pipeline: their slots, without the head
        bubble = (lay.pp - 1) / lay.virtual_stages * (sum(microbatch_parts(model, train, cluster, lay, False)) + a2a)
    behind, exposed = dp_comm_s(model, train, cluster, lay)
    if train.dp_overlap:  # behind the last backward, bucket by bucket: the last one starts when backward ends
        buckets = max(1, math.ceil(stage_params(model, lay) * train.grad_bytes / train.bucket_bytes))
        window = compute * 2 / lay.flop_passes * (buckets - 1) / buckets  # backward's products
        behind = max(behind / buckets, behind - window)
    dp = behind + exposed
    tied = tied_embedding_s(model, train, cluster, lay)
    shard = lay.dp if lay.zero >= 1 else 1
    optimizer = stage_params(model, lay) / shard * 2 * (train.param_bytes + train.grad_bytes + train.optimizer_bytes)
    optimizer *= cluster.optimizer_traffic
    ranks = lay.dp * lay.tp * lay.pp
    optimizer /= cluster.memory_gbps * 1e9 * cluster.core_share(ranks)
    serial = cluster.interpreter_share(ranks)
    optimizer += stage_tensors(model, lay) / shard * cluster.tensor_overhead_us * 1e-6 / serial
    # The step's fixed cost, and the two one-number all-reduces over every rank (gradient norm, loss).
    overhead = cluster.step_overhead_ms * 1e-3 / serial
    overhead += 2 * ring_allreduce_s(8, ranks, cluster.link(ranks))
    m = lay.microbatches
    step = m * slot + bubble + tied + dp + optimizer + overhead
    tokens = train.batch * model.seq_len
    layer_flops = model.layers * model.layer_flops(tokens) + model.moe_layers * model.moe_extra_flops(tokens)
    model_flops = 3 * (layer_flops + model.logit_flops(tokens))
    executed = model_flops + (layer_flops if lay.checkpointing == "full" else 0.0)
    scope = gradient_exchange_s(stage_params(model, lay) - stage_expert_params(model, lay), train, cluster, lay)[1]
    return Estimate(
        layout=replace(lay, scope=scope), step_s=step, compute_s=m * compute, tp_s=m * tp, pp_s=m * p2p + bubble + tied,
        dp_s=dp, ep_s=m * a2a,
        optimizer_s=optimizer, overhead_s=overhead, memory_bytes=memory_bytes(model, train, cluster, lay),
        tokens_per_s=tokens / step,
        tflops_per_gpu=executed / step / ranks / 1e12, mfu=model_flops / step / ranks / cluster.peak_flops(train.dtype),
    )


# The codecs hpc plan weighs for a layout's DP exchange: the near-exact ones with error feedback, whose loss curve
# follows the uncompressed one (docs/BENCHMARKS.md: time to loss); top-k and PowerSGD change the optimization too
# much to be chosen for speed alone. "Pays": saves at least this share of the step.
ADVISED_CODECS = ("none", "bf16", "int8")
PAYS = 0.05


def compression_advice(model: Transformer, train: Training, cluster: Cluster, gpus: int,
                       zero_stages: tuple[int, ...] = (0,)) -> dict[str, Any] | None:
    """Each of ``ADVISED_CODECS`` (flat, and cut by node) planned over every layout: the fastest, recommended only
    where its step is ``PAYS`` shorter than the fastest uncompressed layout's, else none. None when nothing fits.
    ``scope`` is where the codec runs: flat, or inter-node (parallel/hierarchy.py)."""
    from parallel.compression.wire import wire_ratio

    best = {}
    for codec in ADVISED_CODECS:
        for scope in ("flat", "inter-node") if codec != "none" else ("flat",):
            trial = replace(train, wire_ratio=wire_ratio(codec, train.grad_bytes), codec=codec, compression_scope=scope)
            fitting = plan(model, trial, cluster, gpus, zero_stages).fitting
            if fitting:
                best[codec, scope] = fitting[0]
    if ("none", "flat") not in best:
        return None
    exact = best["none", "flat"]
    (codec, scope), fastest = min(best.items(), key=lambda item: item[1].step_s)
    if fastest.step_s > (1 - PAYS) * exact.step_s:
        (codec, scope), fastest = ("none", "flat"), exact
    return {"codec": codec, "scope": scope, "layout": fastest.layout.label(), "step_s": fastest.step_s,
            "uncompressed_step_s": exact.step_s,
            "steps": {f"{c} {s}": e.step_s for (c, s), e in best.items()}}


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def layout_problem(model: Transformer, train: Training, want: Mapping[str, Any]) -> str | None:
    """Why no layout of ``model`` can have what ``want`` gives, or None: the rules ``layouts`` enumerates by.
    ``want``: dp, tp and pp, and optionally m (microbatches), schedule ((name, chunks or None)), zero and ep: tp
    divides the heads and the KV heads, pp the layers, dp the batch, m the replica's batch; a schedule other than
    1f1b needs a pipeline, interleaved m a multiple of pp and chunks dividing a stage's layers; ep divides both dp
    and the experts; ZeRO needs dp > 1."""
    dp, tp, pp, m, ep = want["dp"], want["tp"], want["pp"], want.get("m"), want.get("ep", 1)
    name, chunks = want.get("schedule", ("1f1b", None))
    stage = model.layers // pp
    if model.heads % tp:
        return f"tp={tp} does not divide the model's {model.heads} heads"
    if model.kv % tp:
        return f"tp={tp} does not divide the model's {model.kv} KV heads"
    if model.layers % pp:
        return f"pp={pp} does not divide the model's {model.layers} layers"
    if train.batch % dp:
        return f"dp={dp} does not divide the global batch of {train.batch} sequences"
    if m and train.batch // dp % m:
        return f"m={m} does not divide a replica's batch of {train.batch // dp} sequences"
    if name != "1f1b" and pp == 1:
        return f"schedule={name} needs a pipeline (pp > 1)"
    if name == "interleaved" and m and m % pp:
        return f"interleaved needs m a multiple of pp={pp}, got m={m}"
    if name == "interleaved" and stage < 2:
        return "interleaved needs at least 2 layers per stage"
    if chunks and stage % chunks:
        return f"interleaved/{chunks}: {chunks} does not divide a stage's {stage} layers"
    if ep > 1 and not model.experts:
        return f"ep={ep} needs a mixture of experts"
    if ep > 1 and (dp % ep or model.experts % ep):
        return f"ep={ep} must divide dp={dp} and the {model.experts} experts"
    if want.get("zero") and dp == 1:
        return "ZeRO shards over data parallelism: it needs dp > 1"
    return None


def matches(lay: Layout, want: Mapping[str, Any]) -> bool:
    """Whether ``lay`` has everything ``want`` gives (``layout_problem``'s keys, and ckpt)."""
    have = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "m": lay.microbatches, "ckpt": lay.checkpointing,
            "zero": lay.zero, "ep": lay.ep}
    for key, value in want.items():
        if key == "schedule":
            if lay.schedule != value[0] or (value[1] is not None and lay.virtual_stages != value[1]):
                return False
        elif have[key] != value:
            return False
    return True


def layouts(model: Transformer, train: Training, gpus: int, zero_stages: tuple[int, ...] = (0,)) -> Iterator[Layout]:
    """Every layout of ``gpus`` ranks that ``layout_problem`` lets through, ep, m, checkpointing, ZeRO stage and
    schedule each tried in turn."""
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            for ep in _divisors(dp) if model.experts else [1]:
                mesh = {"dp": dp, "tp": tp, "pp": pp, "ep": ep}
                if layout_problem(model, train, mesh) is None:
                    yield from _schedules(model, train, mesh, zero_stages)


def _schedules(model: Transformer, train: Training, mesh: dict[str, int],
               zero_stages: tuple[int, ...]) -> Iterator[Layout]:
    dp, pp = mesh["dp"], mesh["pp"]
    schedules = (("1f1b", None), ("gpipe", None), *(("interleaved", v) for v in _divisors(model.layers // pp)[1:]))
    for m in _divisors(train.batch // dp):
        for ckpt in RECOMPUTES:
            for zero in zero_stages if dp > 1 else (0,):
                for name, v in schedules:
                    if layout_problem(model, train, {**mesh, "m": m, "schedule": (name, v), "zero": zero}) is None:
                        yield Layout(dp, mesh["tp"], pp, m, name, v or 1, ckpt, zero, mesh["ep"])


@dataclass(frozen=True)
class Plan:
    """Every layout that fits, fastest first; when none fits, how far the leanest one misses."""

    fitting: tuple[Estimate, ...]
    considered: int
    leanest: Estimate | None  # the layout needing the least memory
    capacity_bytes: float

    @property
    def shortfall_bytes(self) -> float:
        return 0.0 if self.fitting or self.leanest is None else self.leanest.memory_bytes - self.capacity_bytes


def plan(model: Transformer, train: Training, cluster: Cluster, gpus: int,
         zero_stages: tuple[int, ...] = (0,), only: Callable[[Layout], bool] | None = None) -> Plan:
    """Estimate every layout of ``gpus`` ranks (those ``only`` accepts); keep those whose memory fits a device,
    fastest first."""
    capacity = cluster.memory_gib * GIB * cluster.usable_memory
    fitting: list[Estimate] = []
    leanest: Estimate | None = None
    considered = 0
    for lay in layouts(model, train, gpus, zero_stages):
        if only is not None and not only(lay):
            continue
        considered += 1
        need = memory_bytes(model, train, cluster, lay)
        if need <= capacity:
            fitting.append(estimate(model, train, cluster, lay))
        elif not fitting and (leanest is None or need < leanest.memory_bytes):
            leanest = estimate(model, train, cluster, lay)
    fitting.sort(key=lambda e: (e.step_s, e.memory_bytes))
    return Plan(tuple(fitting), considered, leanest, capacity)


def best_of(estimates: tuple[Estimate, ...], dp: int, tp: int, pp: int) -> Estimate | None:
    """The fastest fitting estimate with this (dp, tp, pp), whatever its microbatches, schedule and checkpointing."""
    return next((e for e in estimates if (e.layout.dp, e.layout.tp, e.layout.pp) == (dp, tp, pp)), None)


# The spec keys the planner reads (hpc plan refuses a --set of any other): spec_gpt's, spec_training's (the batch, the
# optimizer's bytes, the codec, the DP all-reduce's overlap and buckets) and spec_layout's, the spec's own layout that
# hpc plan ranks among the others. Every model.args.* key too (jobs/models/shape.py reads a model.entry's config or
# counts it).
SPEC_LAYOUT_KEYS = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.ep", "parallel.microbatches",
                    "parallel.schedule", "parallel.virtual_stages", "train.activation_checkpointing",
                    "train.recompute")
PLANNED_KEYS = ("model.kind", "model.entry", "model.n_layers", "model.d_model", "model.n_heads", "model.seq_len",
                "model.moe_experts", "model.moe_top_k", "model.moe_every", "data.batch_size", "train.optimizer",
                "train.momentum", "train.bf16_autocast", "train.compile", "parallel.compression",
                "parallel.topk_fraction", "parallel.powersgd_rank", "parallel.compression_scope", "parallel.overlap",
                "parallel.bucket_mb", *SPEC_LAYOUT_KEYS)


def spec_gpt(spec: JobSpec) -> Transformer:
    """A job spec's built-in GPT (``model.kind = "gpt"``), its mixture of experts included; its head is a Linear of
    its own (jobs/models/gpt.py), not the embedding."""
    m = spec.model
    return Transformer(m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size, experts=m.moe_experts,
                       top_k=m.moe_top_k, moe_every=m.moe_every, tied=False)


def spec_training(spec: JobSpec, hidden: int, batch: int | None = None, overlap: bool = True) -> Training:
    """Our training loop's step of ``spec``: fp32 weights and gradients, the optimizer's state, bf16 products and
    2-byte activations under ``train.bf16_autocast``, the codec's wire ratio (parallel/compression/wire.py; PowerSGD's
    of an h x h matrix); ``batch`` and ``overlap=False``: ``hpc plan``'s --batch and --no-overlap."""
    half, par = spec.train.bf16_autocast, spec.parallel
    state = OPTIMIZER_BYTES.get(spec.train.optimizer, 4 if spec.train.momentum else 0)  # SGD: its momentum, or none
    ratio = wire_ratio(par.compression, 4, par.topk_fraction, par.powersgd_rank, (hidden, hidden))
    return Training(batch=spec.data.batch_size if batch is None else batch, dtype="bf16" if half else "fp32",
                    act_bytes=2 if half else 4, param_bytes=4, grad_bytes=4, optimizer_bytes=state, wire_ratio=ratio,
                    codec=par.compression,
                    dp_overlap=par.overlap and overlap, bucket_bytes=par.bucket_mb * 2**20, p2p_split_over_tp=False,
                    compression_scope=par.compression_scope, fused_attention=True, compiled=spec.train.compile,
                    fused_head_loss=spec.train.fused_head_loss)


def spec_layout(spec: JobSpec, ranks: int) -> Layout:
    """A spec's ``[parallel]`` layout on ``ranks``, as ``hpc run`` lays it out (``dp = "auto"``: ranks / (tp pp))."""
    par = spec.parallel
    dp = ranks // (par.tp * par.pp) if par.dp == "auto" else par.dp
    return Layout(dp, par.tp, par.pp, par.microbatches, par.schedule,
                  par.virtual_stages if par.schedule == "interleaved" else 1,
                  spec.train.recompute if spec.train.activation_checkpointing else "", par.zero, par.ep)
