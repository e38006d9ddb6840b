"""Expert-parallel, layer-streaming replay on torch.distributed (docs/decisions.md, "Expert-parallel replay").

The replay of ``engine`` with each MoE layer's routed experts split across the ranks and the
canary's windows split across them for everything else. One decoder layer is resident at a
time, as in one process; a rank holds its own experts of it, the replicated tensors (norms,
attention, router, shared expert) and the inputs of its own windows.

Forward, per layer, on every rank:

1. attention of the rank's windows (windows are independent: the causal mask is per window);
2. all-gather of h (the residual entering the MoE block) so that every rank routes all N tokens
   with the replicated router: the routing is the same bits on every rank;
3. the rank's experts over the tokens routed to them (each expert's batch is the one it gets in
   one process: the same tokens in the same order), written into their slots of u [N, K, H],
   the other slots zero; an all-reduce brings the slots together — exactly, since every slot
   has one non-zero contribution and x + 0 = x;
4. the combine Σ_k c_k u_k and the shared expert for the rank's windows.

Rank 0 also gets the full tap (h, y, routing, u, the extra sets the observers ask for) and
runs the observers, so the receipts are computed from the taps one process would see.

Backward, in reverse, from each layer's stored inputs (the rank's windows): attention, norms,
router and shared expert through autograd on the rank's windows, their weight gradients
summed over the ranks (one all-reduce per layer); the routed experts on their owners over all
tokens routed to them (dL/dy all-gathered), each expert's gradient norm where the expert lives,
dL/dy per (token, slot) brought together as in the forward and summed per token in expert
order, as ``experts_backward`` sums it in one process.

What is bit-identical to one process and what is not: the routing, u, dL/dc and each expert's
weight gradient are formed from the same operands in the same order, and the sums over slots
are taken in the same order; what differs is the row count of the matrix products of
attention, router and shared expert (a rank multiplies its windows' rows, not all), and the
sums over the ranks of the replicated tensors' weight gradients. tests/test_sharded.py bounds
the differences (docs/benchmarks.md states the measured ones).

Reading: each rank reads the replicated tensors of a layer and only its own experts (per-expert
tensors by key; fused [E, …] tensors by the byte range of its rows), through the files' seals
(``dist``: hashed across the ranks; ``rank_bytes``: the stored blocks a rank needs, sent to it
by the rank that hashed them and kept, so the backward reads nothing again within the budget),
and reads the next layer on a thread while it computes this one. A layout it cannot slice
(MXFP4, block-scaled fused tensors) is read whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from moeaudit.checkpoint.checkpoint import Checkpoint, LayerWeights, StoredExperts
from moeaudit.checkpoint.safetensors import SafetensorsFile, torch_dtype
from moeaudit.errors import CheckpointError, InputError
from moeaudit.replay.blocks.backward import layer_backward
from moeaudit.replay.device import moved, on_device, prepare_device, release_freed_memory, replay_scope, to_host
from moeaudit.replay.dist import RankFailed, Session, absolute, is_comm_error, lost
from moeaudit.replay.finite import all_finite, nonfinite_names
from moeaudit.replay.head import head_biases, lm_head_pass, loss_grad
from moeaudit.replay.model import (
    MoETap,
    Routing,
    _expert_slots,
    decoder_layer,
    experts_backward,
    experts_forward_sets,
    input_scales,
    moe_router,
    rope_tables,
    shared_expert,
)
from moeaudit.replay.model import embed as embed_tokens
from moeaudit.replay.result import LayerGrads, Observer, Progress, ReplayResult, detached, extra_requests
from moeaudit.replay.shards import experts_of, windows_of
from moeaudit.spec.config import ModelSpec

# ----- rank 0 and the serving ranks ---------------------------------------------------------


def check_shardable(spec: ModelSpec) -> None:
    """Refuse, naming it, the first block of ``spec``'s layers that the expert-parallel replay does
    not replay (``spec.blocks``: a block's ``sharded``), e.g. JetMoE's mixture of attention heads:
    it would run in each rank's attention block, but the ranks' MoE forward and backward form
    routed + shared without the bias on the MoE output, and no multi-rank run has been checked on it."""
    for layer in spec.layers:
        if (why := layer.sharded_refusal()) is not None:
            raise InputError(
                f"the expert-parallel replay does not replay {spec.family}'s {why} yet",
                hint="replay it on one process (without --nproc)",
            )


def sharded_replay(
    sess: Session,
    ckpt: Checkpoint,
    tokens_WT: torch.Tensor,
    *,
    backward: bool,
    observers: Sequence[Observer],
    progress: Progress | None,
    dtype: torch.dtype,
    device: torch.device | None,
) -> ReplayResult:
    """Rank 0: the replay of ``engine.replay`` across the session's ranks."""
    W = tokens_WT.shape[0]
    check_shardable(ckpt.spec)
    if W < sess.world:
        raise InputError(
            f"the canary has {W} windows and the replay {sess.world} ranks: each rank replays its own windows",
            hint=f"use at most --nproc {W}",
        )
    try:
        sess.ensure_sealed(absolute(ckpt.path))
        extra = extra_requests(observers)
        sess.request(
            "replay",
            dir=str(absolute(ckpt.path)),
            tokens=tokens_WT.tolist(),
            backward=backward,
            dtype=str(dtype).removeprefix("torch."),
            device=None if device is None else device.type,
            extra=extra is not None,
        )
        result = _run(
            sess,
            ckpt,
            tokens_WT,
            backward=backward,
            dtype=dtype,
            device=device,
            observers=observers,
            extra=extra,
            tick=progress or (lambda *_: None),
        )
        sess.done()
    except Exception as exc:
        if is_comm_error(exc):
            raise lost(exc) from exc
        raise
    assert result is not None
    return result


def serve_replay(sess: Session, ckpt: Checkpoint, req: dict[str, Any]) -> None:
    """A serving rank's part of rank 0's ``replay`` request."""
    tokens = torch.tensor(req["tokens"], dtype=torch.long)
    dtype = getattr(torch, req["dtype"])
    device = None
    if req["device"] is not None:  # each rank its own device of the type rank 0 computes on
        index = int(os.environ.get("LOCAL_RANK", "0"))
        device = prepare_device(f"{req['device']}:{index}" if req["device"] == "cuda" else req["device"])
    with replay_scope(device):
        _run(
            sess,
            ckpt,
            tokens,
            backward=req["backward"],
            dtype=dtype,
            device=device,
            observers=(),
            extra=_ask_rank0 if req["extra"] else None,
            tick=lambda *_: None,
        )


def _ask_rank0(_layer: int, _routing: Routing) -> dict[str, torch.Tensor]:
    return {}  # a serving rank receives the sets rank 0's observers asked for (``_Ctx.share_sets``)


# ----- the ranks' view of the canary and of a layer -----------------------------------------


@dataclass
class _Ctx:
    sess: Session
    win: range  # this rank's windows
    wins: list[range]
    mine: range  # this rank's experts
    T: int
    device: torch.device | None

    @property
    def rank(self) -> int:
        return self.sess.rank

    @property
    def rows(self) -> slice:
        """This rank's tokens among the N = W·T."""
        return slice(self.win.start * self.T, self.win.stop * self.T)

    def gather_windows(self, own: torch.Tensor) -> torch.Tensor:
        """[w_r, …] of each rank → [W, …] on every rank (padded to the largest share)."""
        top = max(len(w) for w in self.wins)
        buf = own.new_zeros((top, *own.shape[1:]))
        buf[: own.shape[0]] = own
        parts = [torch.empty_like(buf) for _ in self.wins]
        dist.all_gather(parts, buf)
        return torch.cat([p[: len(w)] for p, w in zip(parts, self.wins, strict=True)])

    def slots_together(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks of tensors whose every element is non-zero on at most one rank:
        exact (x + 0 = x), so the result is the one-process tensor bit for bit."""
        dist.all_reduce(t)
        return t

    def share_sets(self, wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The expert-index sets rank 0's observers asked for, on every rank."""
        names = self.sess.bcast_json({n: list(t.shape) for n, t in wanted.items()} if self.rank == 0 else None)
        out = {}
        for name, shape in names.items():
            t = (
                wanted[name].to("cpu", torch.long).contiguous()
                if self.rank == 0
                else torch.empty(shape, dtype=torch.long)
            )
            dist.broadcast(t, 0)
            out[name] = t if self.device is None else t.to(self.device)
        return out


@contextmanager
def own_experts(ckpt: Checkpoint, mine: range) -> Iterator[None]:
    """``ckpt.layer_weights`` reads only the experts in ``mine`` (the others stay empty) while
    the replay runs; the checkpoint reads every expert again afterwards."""
    whole = ckpt._stored_experts

    def stored(layer: int, dtype: torch.dtype) -> StoredExperts:
        return _own_stored(ckpt, layer, dtype, mine) or whole(layer, dtype)

    setattr(ckpt, "_stored_experts", stored)  # noqa: B010 - on this instance, for this replay
    try:
        yield
    finally:
        delattr(ckpt, "_stored_experts")


def _own_stored(ckpt: Checkpoint, layer: int, dtype: torch.dtype, mine: range) -> StoredExperts | None:
    """The layer's experts with only ``mine`` read, or None where the layout cannot be sliced."""
    E = ckpt.spec.num_experts
    keys = ckpt.expert_keys(layer)
    if isinstance(keys, list):  # a tensor per expert: read its own (FP8 ones dequantised by read)
        return StoredExperts(
            [{n: ckpt.read(k) for n, k in table.items()} if e in mine else {} for e, table in enumerate(keys)], dtype
        )
    names = list(keys.values())
    if ckpt.fused_format not in ("stacked", "interleaved", "interleaved_rows", "transposed"):
        return None  # a layout this reader does not slice (DBRX's flat [E·I, H]): read whole
    if any(k in ckpt.packed or k in ckpt.scales or k not in ckpt.key_file for k in names):
        return None
    if not all(isinstance(ckpt.files[ckpt.key_file[k]], SafetensorsFile) for k in names):
        return None
    rows = {n: _read_rows(ckpt, k, mine.start, mine.stop) for n, k in keys.items()}
    I, fmt = ckpt.spec.expert_dim, ckpt.fused_format
    gate_up, down = rows["gate_up"], rows["down"]
    own: list[dict[str, torch.Tensor]]
    if fmt in ("interleaved", "interleaved_rows"):  # gpt-oss in bf16 (MXFP4 is read whole)
        if fmt == "interleaved":
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        b_gu, b_down = rows["gate_up_bias"], rows["down_bias"]
        own = [
            {
                "w1": gate_up[j, 0::2],
                "w3": gate_up[j, 1::2],
                "w2": down[j],
                "b1": b_gu[j, 0::2],
                "b3": b_gu[j, 1::2],
                "b2": b_down[j],
            }
            for j in range(len(mine))
        ]
    elif fmt == "transposed":
        own = [{"w1": gate_up[j, :, :I].T, "w3": gate_up[j, :, I:].T, "w2": down[j].T} for j in range(len(mine))]
    else:
        own = [{"w1": gate_up[j, :I], "w3": gate_up[j, I:], "w2": down[j]} for j in range(len(mine))]
    stored: list[dict[str, torch.Tensor]] = [{} for _ in range(E)]
    for j, e in enumerate(mine):
        stored[e] = own[j]
    return StoredExperts(stored, dtype)


def _read_rows(ckpt: Checkpoint, key: str, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of a stored [E, …] tensor: only their bytes, through the file's seal."""
    f = ckpt.files[ckpt.key_file[key]]
    assert isinstance(f, SafetensorsFile)
    info = f.tensors[key]
    shape = (hi - lo, *info.shape[1:])
    row = (info.end - info.begin) // max(1, info.shape[0])
    buf = bytearray(row * (hi - lo))
    if buf and f.seal().read_into(info.begin + lo * row, buf) != len(buf):
        raise CheckpointError(f"tensor {key!r}: file ended early", path=f.path)
    dtype = torch_dtype(info.dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape) if buf else torch.empty(shape, dtype=dtype)


class _Reader:
    """A rank's layers, the next one read on a thread while this one is computed."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, rank: int):
        self.ckpt, self.dtype, self.rank = ckpt, dtype, rank
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="moeaudit-prefetch")
        self.pending: dict[int, Future[LayerWeights]] = {}
        self.fault = _fault(rank)

    def _read(self, layer: int) -> LayerWeights:
        if self.fault is not None and self.fault[0] == layer:
            if self.fault[1] == "exit":
                os._exit(9)  # a rank that dies (test hook)
            raise CheckpointError(f"injected read failure in layer {layer} (${FAULT_ENV})", path=self.ckpt.path)
        return self.ckpt.layer_weights(layer, self.dtype, lazy_experts=True)

    def get(self, layer: int, then: int | None) -> LayerWeights:
        fut = self.pending.pop(layer, None) or self.pool.submit(self._read, layer)
        try:
            return fut.result()
        finally:
            if then is not None:
                self.pending[then] = self.pool.submit(self._read, then)

    def close(self) -> None:
        for fut in self.pending.values():
            fut.cancel()
        self.pool.shutdown(wait=True)


FAULT_ENV = "MOEAUDIT_TEST_RANK_FAULT"


def _fault(rank: int) -> tuple[int, str] | None:
    """``$MOEAUDIT_TEST_RANK_FAULT`` = RANK:LAYER:error|exit (tests only): this rank fails when it
    reads that layer, by an error or by dying."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    r, layer, kind = spec.split(":")
    return (int(layer), kind) if int(r) == rank else None


# ----- the replay ------------------------------------------------------------------------------


def _run(
    sess: Session,
    ckpt: Checkpoint,
    tokens_WT: torch.Tensor,
    *,
    backward: bool,
    dtype: torch.dtype,
    device: torch.device | None,
    observers: Sequence[Observer],
    extra: Callable[[int, Routing], dict[str, torch.Tensor]] | None,
    tick: Progress,
) -> ReplayResult | None:
    spec = ckpt.spec
    tokens_WT = tokens_WT.long()
    W, T = tokens_WT.shape
    wins = windows_of(W, sess.world)
    ctx = _Ctx(sess, wins[sess.rank], wins, experts_of(spec.num_experts, sess.world)[sess.rank], T, device)
    devices = sess.gather_bytes(str(device or "cpu").encode())
    rope = rope_tables(spec, T)
    rope = rope if device is None else moved(rope, device)
    n_steps = spec.num_layers * (2 if backward else 1)
    reader = _Reader(ckpt, dtype, sess.rank)
    pending: list[BaseException] = []  # an observer's failure on rank 0, reported at the next step
    try:
        with own_experts(ckpt, ctx.mine):
            x, inputs, routing, bad = _forward(
                ctx, spec, ckpt, reader, tokens_WT, rope, dtype, observers, extra, pending, tick, n_steps
            )
            head, nll = _head(ctx, spec, ckpt, x, tokens_WT, dtype, backward, bad, pending)
            del x
            result = None
            if sess.rank == 0:
                nll_v, nll_W, entropy = nll
                result = ReplayResult(nll_v, nll_W, entropy, routing, nonfinite_weights=bad)
                result.parallel = {
                    "world_size": sess.world,
                    "backend": _backend_of(sess, device),
                    "rank_devices": [d.decode() for d in devices],
                }
            if backward:
                grads = _backward(ctx, spec, reader, inputs, head, rope, device, pending, tick, n_steps)
                if result is not None:
                    result.grads = grads
            sess.agree(pending[0] if pending else None)
            return result
    finally:
        reader.close()


def _backend_of(sess: Session, device: torch.device | None) -> str:
    return "nccl" if device is not None and device.type == "cuda" and "nccl" in sess.backend else "gloo"


def _step(sess: Session, read: Callable[[], Any], pending: list[BaseException]) -> Any:
    """Run a rank's read, then agree with the other ranks that every one succeeded."""
    got: Any = None
    error: BaseException | None = None
    try:
        got = read()
    except Exception as exc:  # noqa: BLE001 - reported by every rank as one line
        error = exc
    if error is None and pending:
        error = pending[0]
    sess.agree(error)
    return got


def _forward(
    ctx: _Ctx,
    spec: ModelSpec,
    ckpt: Checkpoint,
    reader: _Reader,
    tokens_WT: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    observers: Sequence[Observer],
    extra: Callable[[int, Routing], dict[str, torch.Tensor]] | None,
    pending: list[BaseException],
    tick: Progress,
    n_steps: int,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[int, Routing], list[str]]:
    sess, device = ctx.sess, ctx.device
    bad: list[str] = []

    def read_embed() -> torch.Tensor:
        embed = ckpt.read_global("embed", None)
        if not all_finite(embed):
            bad.append("embed")
        return embed

    embed = _step(sess, read_embed, pending)
    with torch.no_grad():
        x = embed_tokens(spec, embed, tokens_WT[ctx.win.start : ctx.win.stop], dtype)
    del embed
    x = x if device is None else moved(x, device)
    inputs: list[torch.Tensor] = []
    routing: dict[int, Routing] = {}
    names: dict[int, list[str]] = {}  # non-finite weights this rank found, by layer
    L = spec.num_layers
    for i in range(L):
        lw: LayerWeights = _step(sess, partial(reader.get, i, i + 1 if i + 1 < L else None), pending)
        names[i] = nonfinite_names(lw)
        inputs.append(x)
        with torch.no_grad():
            x, tap = _forward_layer(ctx, spec, on_device(lw, device), x, rope, extra)
        if tap is not None:
            if device is not None:
                tap = to_host(tap, device)
            routing[i] = detached(tap.routing)
            try:
                for observe in observers:
                    observe(tap, lw)
            except Exception as exc:  # noqa: BLE001 - every rank stops at the next step
                pending.append(exc)
        del lw, tap
        release_freed_memory()
        if ctx.rank == 0:
            tick(f"forward layer {i + 1}/{L}", i + 1, n_steps)
    # every rank's non-finite experts, in the order one process lists them
    import json

    parts = [
        json.loads(p.decode())
        for p in sess.gather_bytes(
            json.dumps({i: [n for n in got if n.startswith(f"layer {i} expert ")] for i, got in names.items()}).encode()
        )
    ]
    if ctx.rank == 0:
        for i in range(L):
            bad += [n for n in names[i] if not n.startswith(f"layer {i} expert ")]
            bad += [n for part in parts for n in part[str(i)]]
    return x, inputs, routing, bad


def _forward_layer(
    ctx: _Ctx,
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    extra: Callable[[int, Routing], dict[str, torch.Tensor]] | None,
) -> tuple[torch.Tensor, MoETap | None]:
    """``decoder_layer`` on the rank's windows, its MoE block's experts computed by their owners
    over every rank's tokens (the taps kept on rank 0)."""

    def moe(spec: ModelSpec, lw: LayerWeights, moe_in: torch.Tensor) -> tuple[torch.Tensor, MoETap | None]:
        B, T, H = moe_in.shape
        h_NH = ctx.gather_windows(moe_in).reshape(-1, H)
        y_NH, routing = moe_router(spec, lw, h_NH)
        wanted: dict[str, torch.Tensor] = {}
        if extra is not None:
            asked = {}
            if ctx.rank == 0:
                asked = extra(lw.layer, routing if ctx.device is None else to_host(routing, ctx.device))
            wanted = ctx.share_sets(asked)
        sets = [routing.topk_NK, *wanted.values()]
        outs = experts_forward_sets(
            lw.experts, y_NH, sets, spec.expert_glu(lw.layer), input_scales(spec, routing, sets), only=ctx.mine
        )
        u_NKH, *more = [ctx.slots_together(u) for u in outs]
        rows = ctx.rows
        out = (u_NKH[rows] * routing.combine_NK[rows].to(u_NKH.dtype)[..., None]).sum(1)
        if spec.shared_dim:
            out = out + shared_expert(spec, lw.params, y_NH[rows], lw.layer)
        if ctx.rank != 0:
            return out.view(B, T, H), None
        tap = MoETap(
            lw.layer,
            h_NH,
            y_NH,
            routing,
            u_NKH,
            dict(zip(wanted, more, strict=True)),
            _eps=spec.rms_eps,
            _centred=spec.layer_norm,
        )
        return out.view(B, T, H), tap

    return decoder_layer(spec, lw, x_BTH, rope, moe=moe)


def _head(
    ctx: _Ctx,
    spec: ModelSpec,
    ckpt: Checkpoint,
    x: torch.Tensor,
    tokens_WT: torch.Tensor,
    dtype: torch.dtype,
    backward: bool,
    bad: list[str],
    pending: list[BaseException],
) -> tuple[torch.Tensor | None, tuple[float, torch.Tensor, float]]:
    """The LM head over the rank's windows; (dL/dx of them, (NLL, NLL per window, entropy))."""
    device = ctx.device

    def read() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        return ckpt.read_global("final_norm", dtype), ckpt.read_global("lm_head", dtype), head_biases(ckpt, dtype)

    final_norm, lm_head, biases = _step(ctx.sess, read, pending)
    if ctx.rank == 0:
        bad += [n for n, t in (("final_norm", final_norm), ("lm_head", lm_head), *biases.items()) if not all_finite(t)]
    W, T = tokens_WT.shape
    own = tokens_WT[ctx.win.start : ctx.win.stop]
    grad_nll = loss_grad(W, T - 1, None)[ctx.win.start : ctx.win.stop] if backward else None
    if device is not None:
        final_norm, lm_head, own, grad_nll, biases = moved((final_norm, lm_head, own, grad_nll, biases), device)
    head = lm_head_pass(spec, final_norm, lm_head, x, own, grad_nll, **biases)
    del final_norm, lm_head
    nll_WT1 = ctx.gather_windows(head.nll_WT1)
    ent_WT1 = ctx.gather_windows(head.entropy_WT1)
    nll, nll_W, entropy = to_host((nll_WT1.mean(), nll_WT1.mean(1), ent_WT1.mean()), device)
    return head.grad_x_WTH, (float(nll), nll_W, float(entropy))


def _backward(
    ctx: _Ctx,
    spec: ModelSpec,
    reader: _Reader,
    inputs: list[torch.Tensor],
    grad: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor],
    device: torch.device | None,
    pending: list[BaseException],
    tick: Progress,
    n_steps: int,
) -> dict[int, LayerGrads]:
    assert grad is not None
    grads: dict[int, LayerGrads] = {}
    L = spec.num_layers
    for step, i in enumerate(reversed(range(L))):
        lw: LayerWeights = _step(ctx.sess, partial(reader.get, i, i - 1 if i > 0 else None), pending)
        grad, layer = layer_backward(spec, on_device(lw, device), inputs[i], grad, rope, device, moe=_ShardedMoE(ctx))
        if layer is not None:
            grads[i] = layer
        inputs[i] = None  # type: ignore[call-overload]
        del lw
        release_freed_memory()
        if ctx.rank == 0:
            tick(f"backward layer {i + 1}/{L}", L + step + 1, n_steps)
    return grads


@dataclass
class _ShardedMoE:
    """The routed experts' backward on their owners (``blocks.backward.MoEBackward``): every token
    routed again with the forward's routing, bit for bit; dL/d(routed output) all-gathered; dL/dy
    per (token, slot) and dL/dc brought together as in the forward and summed per token in expert
    order; the replicated tensors' weight gradients summed over the ranks."""

    ctx: _Ctx

    def routed_output(self, spec: ModelSpec, lw: LayerWeights, y_NH: torch.Tensor, routing: Routing) -> torch.Tensor:
        raise AssertionError("refused by check_shardable: an output norm or hyper-connections")

    def experts(
        self,
        spec: ModelSpec,
        lw: LayerWeights,
        moe_in_BTH: torch.Tensor,
        y_own: torch.Tensor,
        routing_own: Routing,
        g_own: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx = self.ctx
        B, T, H = moe_in_BTH.shape
        with torch.no_grad():  # every token, for the experts: the forward's routing, bit for bit
            y_NH, routing = moe_router(spec, lw, ctx.gather_windows(moe_in_BTH.detach()).reshape(-1, H))
        g_NH = ctx.gather_windows(g_own.view(B, T, H)).reshape(-1, H)
        back = experts_backward(
            lw.experts,
            y_NH,
            routing.topk_NK,
            routing.combine_NK,
            g_NH,
            spec.expert_glu(lw.layer),
            spec.moe.scaled_inputs,
            only=ctx.mine,
            slot_dx=True,
        )
        assert back.dx_SH is not None
        dx_SH = ctx.slots_together(back.dx_SH)
        dc_NK = ctx.slots_together(back.combine_NK.contiguous())
        sq_E = ctx.slots_together(back.sq_E)
        dy_NH = _slot_sum(dx_SH, routing.topk_NK, len(lw.experts))
        rows = ctx.rows
        return dy_NH[rows], dc_NK[rows], sq_E

    def finish(self, lw: LayerWeights) -> None:
        _sum_weight_grads(lw)


def _slot_sum(dx_SH: torch.Tensor, topk_NK: torch.Tensor, E: int) -> torch.Tensor:
    """Σ over each token's slots of dL/dy, added in expert order as ``experts_backward`` adds them."""
    N, K = topk_NK.shape
    order, counts = _expert_slots(topk_NK, E)
    dy = dx_SH.new_zeros(N, dx_SH.shape[1])
    start = 0
    for c in counts:
        if c:
            slots = order[start : start + c]
            dy.index_add_(0, slots // K, dx_SH[slots])
        start += c
    return dy


def _sum_weight_grads(lw: LayerWeights) -> None:
    """The replicated tensors' weight gradients summed over the ranks (one all-reduce)."""
    held = [t for t in lw.params.values() if t.grad is not None]
    if not held:
        return
    flat = torch.cat([t.grad.reshape(-1) for t in held if t.grad is not None])
    dist.all_reduce(flat)
    at = 0
    for t in held:
        assert t.grad is not None
        n = t.grad.numel()
        t.grad.copy_(flat[at : at + n].view_as(t.grad))
        at += n


__all__ = ["RankFailed", "serve_replay", "sharded_replay"]
