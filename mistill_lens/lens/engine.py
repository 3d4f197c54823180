"""Exact interventions at decode cost.

Every intervention of this toolkit edits head outputs (``hook_z``) at a decision event's
predicting position ``p`` and reads the margin there. Causal attention means nothing before ``p``
changes, so an intervention whose first edited layer is ``l`` needs only the clean keys and values
of positions ``< p`` (one clean pass per example, shared by all its events) and a recomputation of
the single position ``p`` through layers ``l .. L-1``: the cost of one decode step, not of a
forward over the whole context. Many (intervention, event) items share each step in the batch.

:class:`InterventionEngine` wraps a model (a ``TransformerBridge`` or the Hugging Face model under
it) and answers the questions the hook-based code asks of a full forward:

* ``margins(batch, hooks_for)``: each event's margin with ``hooks_for(view)``'s hooks applied,
  where ``view`` is the *event-position view* of the batch: the same events with one position each
  (``view.predict_positions`` all 0). The hook factories of :mod:`mistill_lens.lens.hooks`
  (mean ablation, ablate-all-but, knock-in, and any combination) build the same hooks for that view
  as for the full rows, so one ``hooks_for`` runs in both, with the same result.
* ``attribution(batch, means)``: gradient x (activation - mean) per head at every event, through
  the same single-position recomputation (exact: the margin at ``p`` depends on ``hook_z`` at ``p``
  only through position ``p``).
* ``event_z(batch)`` (the clean ``hook_z`` at each event, for knock-in sources) and
  ``event_patterns(batch, layer)`` (attention rows at the events, without a [T, T] pattern).

What the engine accepts: hooks on ``blocks.{l}.attn.hook_z`` whose function maps an activation of
shape [n, 1, head, d_head] (the events' predicting positions) to one of the same shape. A hook on
another name, or one that changes other positions, needs the full forward: ``margins`` raises
:class:`EngineUnsupported` and :func:`mistill_lens.lens.backends.chunked_margins` then falls back to
the full forward with a warning. Models: GPT-2 and Llama-family causal LMs (grouped key/value
heads and rotary positions included). The clean pass runs the Hugging Face model with memory-
efficient attention (SDPA), so memory grows linearly in the context length.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterator, Sequence

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge
from transformers import DynamicCache, PreTrainedModel

from mistill_lens.lens.adapters import EngineUnsupported, adapter_for
from mistill_lens.lens.events import EventBatch, row_chunks
from mistill_lens.lens.hooks import (
    Head,
    HeadMeans,
    HookPair,
    check_hook_names,
    class_means,
    event_position_classes,
    row_head_ablation_hooks,
    row_set_ablation_hooks,
    z_hook_name,
)
from mistill_lens.lens.margins import decision_margins, row_margins, run_margins
from mistill_lens.lens.model_types import StandsIn

_Z_NAME = re.compile(r"^blocks\.(\d+)\.attn\.hook_z$")
# hook points the engine applies at the events' predicting positions, by site within a layer.
# Not hook_resid_mid: TransformerLens 4.3's bridge feeds an edited hook_resid_mid to the MLP but adds
# the unedited one to the residual (0.29 logits off on GPT-2), so it runs on the full forward.
_SITES = ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_mlp_out", "hook_resid_post")
_HOOK_NAME = re.compile(r"^blocks\.(\d+)\.(" + "|".join(re.escape(s) for s in _SITES) + r")$")


@dataclass
class _ExampleCache:
    """One clean pass of one example's context (up to its last event's predicting position)."""

    tokens: Tensor  # [T]
    keys: list[Tensor]  # per layer [kv_head, T, d_head] (rotary applied)
    values: list[Tensor]  # per layer [kv_head, T, d_head]
    resid: Tensor  # [layer, n_positions, d_model]: the residual entering each layer
    z: Tensor  # [layer, n_positions, head, d_head]: clean hook_z
    positions: list[int]  # predicting positions, in the order of resid / z

    @property
    def n_bytes(self) -> int:
        tensors = [*self.keys, *self.values, self.resid, self.z]
        return sum(t.numel() * t.element_size() for t in tensors)


def model_tensors(module: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer of `module` (persistent or not, tied names included), under the
    plain Hugging Face names (the bridge inserts `._original_component` into them): what
    :func:`twin_of` needs to rebuild the model exactly, in this process or another."""
    tensors = {
        **dict(module.named_buffers(remove_duplicate=False)),
        **dict(module.named_parameters(remove_duplicate=False)),
    }
    return {re.sub(r"\._original_component", "", name): t for name, t in tensors.items()}


def _put(module: torch.nn.Module, name: str, tensor: Tensor) -> None:
    """Make `tensor` (the same object: shared, not copied) the parameter or buffer `name`."""
    *path, leaf = name.split(".")
    owner = module.get_submodule(".".join(path))
    slots = owner._parameters if leaf in owner._parameters else owner._buffers
    slots[leaf] = tensor


def unbridged(model: TransformerBridge | PreTrainedModel) -> PreTrainedModel:
    """The plain Hugging Face model behind `model` (a bridge, or already a plain model), with
    memory-efficient attention for long contexts, sharing every weight *and every buffer* of the
    model (non-persistent ones included: rotary frequencies, embedding scales, masks), so that it
    computes what the model computes even where buffers differ from what the config implies.

    The twin is built on the meta device (no second copy of the weights, not even a transient one)
    and refuses to exist with anything of its own left unfilled."""
    hf = model if isinstance(model, PreTrainedModel) else getattr(model, "original_model", None)
    if not isinstance(hf, PreTrainedModel):
        raise EngineUnsupported(
            f"{type(model).__name__} is neither a TransformerBridge nor a Hugging Face model"
        )
    if hf is model and hf.config._attn_implementation == "sdpa":
        return hf
    return twin_of(type(hf), hf.config, model_tensors(hf))


def twin_of(model_class: type, config, theirs: dict[str, Tensor]) -> PreTrainedModel:
    """A `model_class` model with memory-efficient attention whose every parameter and buffer is
    the tensor of the same name in `theirs` (shared, not copied), built on the meta device."""
    with torch.device("meta"):
        twin = model_class._from_config(config, attn_implementation="sdpa")
    wanted = model_tensors(twin)
    missing = sorted(set(wanted) - set(theirs))
    if missing:
        raise EngineUnsupported(f"cannot find these tensors behind the model: {missing[:3]}")
    for name in wanted:
        _put(twin, name, theirs[name])
    # plain attributes a model computes from its config at construction (rotary attention
    # scaling, ...) are the config's on both; tensors are the model's own, checked here
    left = [name for name, t in model_tensors(twin).items() if t.is_meta]
    if left:
        raise EngineUnsupported(f"the engine's copy left these tensors unfilled: {left[:3]}")
    return twin.eval()


class EngineMismatch(RuntimeError):
    """The engine disagrees with the model's own forward: its numbers would be wrong."""


class InterventionEngine(StandsIn):
    """Exact interventions on `model` at decision events, at the cost of single-position steps.

    ``cache_bytes`` bounds the clean passes kept (the latest is always kept; least recently used
    ones are recomputed when needed again); ``chunk`` is the number of items one step batches;
    ``grad_rows`` the number of rows one backward pass takes: its graph keeps, per row and
    layer, the attention weights over the row's whole context (by arithmetic ~1.3 MB per row at
    1,200 tokens for SmolLM2's 30 layers x 9 heads in float32, each held in a few forms). At
    512 rows per backward, an n = 150 characterisation of the default teacher went from 6.5 GB
    resident in the clean margins to a peak of 11.25 GB in attribution.
    """

    def __init__(
        self,
        model: TransformerBridge | PreTrainedModel,
        cache_bytes: int = 4 * 2**30,
        chunk: int = 512,
        self_check: bool = True,
        grad_rows: int = 128,
    ):
        self.model = model
        self.hf = unbridged(model)
        self.adapter = adapter_for(self.hf)
        self._hook_points = dict(getattr(model, "hook_dict", None) or {})
        # None: not checked yet; the first batch of events any method sees is checked against the
        # model's own forward before anything is computed from it
        self.check_record: dict | None = None if self_check else {"skipped": True}
        self._checking = False
        self.n_layers = self.adapter.n_layers
        self.n_heads = self.adapter.n_heads
        # the shape the hook factories read (`model.cfg`), also for a plain Hugging Face model
        self.cfg = SimpleNamespace(
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            d_head=self.adapter.d_head,
            n_ctx=self.hf.config.max_position_embeddings
            if hasattr(self.hf.config, "max_position_embeddings")
            else self.hf.config.n_positions,
        )
        self.cache_bytes = cache_bytes
        self.chunk = chunk
        self.grad_rows = grad_rows
        self._caches: OrderedDict[int, _ExampleCache] = OrderedDict()

    # --- clean passes ----------------------------------------------------------------------

    def _contexts(self, batch: EventBatch) -> dict[int, Tensor]:
        """Per example id, the longest context among its rows (every row must be its prefix)."""
        longest: dict[int, int] = {}
        for row, event in enumerate(batch.events):
            best = longest.get(event.example_id)
            if best is None or batch.predict_positions[row] > batch.predict_positions[best]:
                longest[event.example_id] = row
        contexts = {}
        for example_id, row in longest.items():
            contexts[example_id] = batch.tokens[row, : int(batch.predict_positions[row]) + 1]
        for row, event in enumerate(batch.events):
            p = int(batch.predict_positions[row])
            if not torch.equal(batch.tokens[row, : p + 1], contexts[event.example_id][: p + 1]):
                raise EngineUnsupported(
                    f"rows of example {event.example_id} hold different contexts; give each "
                    "example its own example_id"
                )
        return contexts

    @torch.no_grad()
    def _clean_pass(self, tokens: Tensor, positions: list[int]) -> _ExampleCache:
        adapter = self.adapter
        z_at: dict[int, Tensor] = {}
        resid_at: dict[int, Tensor] = {}
        index = torch.tensor(positions)

        def keep_resid(layer):  # the residual entering the layer
            def hook(module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                resid_at[layer] = hidden[0, index].detach()

            return hook

        def keep_z(layer):  # the input of the attention's output projection: hook_z, flattened
            def hook(module, args):
                z_at[layer] = args[0][0, index].detach()

            return hook

        handles = [
            handle
            for layer in range(self.n_layers)
            for handle in (
                adapter.layer_module(layer).register_forward_pre_hook(
                    keep_resid(layer), with_kwargs=True
                ),
                adapter.z_module(layer).register_forward_pre_hook(keep_z(layer)),
            )
        ]
        try:
            device = next(self.hf.parameters()).device
            # with sliding-window layers, a cache that keeps every key: a sliding layer's own
            # cache keeps only the last window of the whole prefix, and an event needs the window
            # ending at its own position
            sliding = any(adapter.window(layer) for layer in range(self.n_layers))
            cache = {"past_key_values": DynamicCache()} if sliding else {}
            out = self.hf(tokens[None].to(device), use_cache=True, logits_to_keep=1, **cache)
        finally:
            for handle in handles:
                handle.remove()
        keys, values = _cache_tensors(out.past_key_values, self.n_layers)
        resid = torch.stack([resid_at[layer] for layer in range(self.n_layers)])
        z = torch.stack(
            [
                einops.rearrange(z_at[layer], "e (h d) -> e h d", h=self.n_heads)
                for layer in range(self.n_layers)
            ]
        )
        return _ExampleCache(tokens, keys, values, resid, z, positions)

    def _cache_for(self, example_id: int, context: Tensor, positions: list[int]) -> _ExampleCache:
        cached = self._caches.get(example_id)
        # a kept pass serves when it covers this context and these positions; when one of the two
        # contexts extends the other, a new pass covers the longer and every position of both
        if cached is not None and torch.equal(
            cached.tokens[: len(context)], context[: len(cached.tokens)]
        ):
            if len(cached.tokens) >= len(context) and set(positions) <= set(cached.positions):
                self._caches.move_to_end(example_id)
                return cached
            positions = [*positions, *cached.positions]
            context = max(context, cached.tokens, key=len)
        cache = self._clean_pass(context, sorted(set(positions)))
        self._caches[example_id] = cache
        self._caches.move_to_end(example_id)
        while len(self._caches) > 1 and sum(c.n_bytes for c in self._caches.values()) > (
            self.cache_bytes
        ):
            self._caches.popitem(last=False)
        return cache

    def prepare(self, batch: EventBatch) -> None:
        """Run (or reuse) the clean pass of every example in `batch`."""
        for rows in example_runs(batch):
            self._groups(batch.select(rows))

    def _each_example(self, batch: EventBatch) -> Iterator[tuple[_ExampleCache, Tensor, Tensor]]:
        """(clean pass, rows of `batch`, their slots in the pass) for one example at a time.
        Why not :meth:`_groups` of the whole batch: its list holds every example's pass until
        the caller is done, past the cache's bound (at n = 150 the means alone held ~8 GB)."""
        for rows in example_runs(batch):
            for cache, sub_rows, slots in self._groups(batch.select(rows)):
                yield cache, rows[sub_rows], slots

    def clear(self) -> None:
        self._caches.clear()

    # --- the self-check ------------------------------------------------------------------------

    def check(self, batch: EventBatch, seed: int = 0) -> dict:
        """Compare the engine with the model's own forward on `batch`'s first example: its events'
        clean margins recomputed from layer 0 through the adapter (every layer, not only the last
        from a cached residual), and one event's margin with a random multi-layer set of heads
        zeroed. A disagreement beyond 2e-3 x the mean |clean margin| (float32, at least 1e-4 logits;
        0.05 x in half precision) raises :class:`EngineMismatch`; the record is kept in ``check_record``."""
        self._checking = True
        try:
            record = self._check(batch, seed)
        finally:
            self._checking = False
        self.check_record = record
        if not record["passed"]:
            raise EngineMismatch(
                f"the intervention engine disagrees with the model's own forward by up to "
                f"{record['max_abs_diff']:.3g} logits (tolerance {record['tolerance']:.3g}, "
                f"{record['n_events']} events; {record['comparisons']}): its numbers would be wrong for "
                "this model. Run on the full forward instead (CharacterizeConfig(engine=False)), "
                "which is exact but costs one forward per event row (~1,500x slower on the "
                "default teacher)"
            )
        return record

    def _check(self, batch: EventBatch, seed: int) -> dict:
        first = batch.events[0].example_id
        rows = [r for r, e in enumerate(batch.events) if e.example_id == first]
        rows = sorted({rows[0], rows[-1]})
        sub = batch.select(rows)
        generator = torch.Generator().manual_seed(seed)
        layers = sorted(set(torch.randint(self.n_layers, (3,), generator=generator).tolist()))
        heads = [(l, int(torch.randint(self.n_heads, (1,), generator=generator))) for l in layers]
        full_clean = self._full_forward_margins(sub, [])
        engine_clean = self._margins_from(sub, 0, [])
        one = sub.select([len(sub) - 1])
        full_ablated = self._full_forward_margins(one, heads)
        engine_ablated = self._margins_from(one, None, heads)
        diffs = {
            "clean, from layer 0": (engine_clean - full_clean).abs().max().item(),
            f"heads {heads} zeroed": (engine_ablated - full_ablated).abs().max().item(),
        }
        worst = max(diffs, key=diffs.get)
        half = self.hf.dtype in (torch.float16, torch.bfloat16)
        # float32: 2e-3 x the mean |clean margin|, at least 1e-4 logits. The same fp32 forward
        # computed two ways (SDPA or eager attention, batched or row by row, 1 or 2 threads)
        # agrees to ~1e-6 x the margin on our machine, but CI's machine once put the engine
        # 6.7e-4 x away on the default teacher (0.0099 of 14.7 logits): a bound below the
        # 2-decimal precision of every reported fraction, which the tests' planted faults (a
        # rotary buffer x1.7, a layer 0 MLP x1.5) still exceed 11-fold and 200-fold
        mean_margin = full_clean.abs().mean().item()
        tolerance = 0.05 * max(mean_margin, 1.0) if half else max(2e-3 * mean_margin, 1e-4)
        return {
            "passed": diffs[worst] <= tolerance,
            "max_abs_diff": diffs[worst],
            "tolerance": tolerance,
            "n_events": len(sub),
            "ablated_heads": [list(h) for h in heads],
            "ablation_effect": (full_clean[-1:] - full_ablated).abs().max().item(),
            "comparisons": "; ".join(f"{what}: {diff:.3g}" for what, diff in diffs.items()),
        }

    def _margins_from(self, batch: EventBatch, start: int | None, heads: list) -> Tensor:
        """Engine margins with `heads` zeroed, recomputed from layer `start` (None: the first
        zeroed layer)."""
        view = event_view(batch)
        layer_hooks = self._layer_hooks(_zero_heads_hooks(view, heads))
        start = min(layer_hooks) if start is None else start
        with torch.no_grad():
            logits = self._run(self._groups(batch), len(batch), start, layer_hooks).float()
        return row_margins(logits, view)

    @torch.no_grad()
    def _full_forward_margins(self, batch: EventBatch, heads: list) -> Tensor:
        """The model's own forward (TransformerLens hooks on a bridge, PyTorch hooks on a plain
        Hugging Face model) with `heads` zeroed at each row's predicting position."""
        hooks = _zero_heads_hooks(batch, heads)
        if hasattr(self.model, "run_with_hooks"):
            return run_margins(self.model, batch, hooks)  # the events' logit rows alone
        adapter = adapter_for(self.model)
        handles = [
            adapter.z_module(int(_Z_NAME.match(name).group(1))).register_forward_pre_hook(
                lambda module, args, fn=fn: (
                    einops.rearrange(
                        fn(
                            einops.rearrange(args[0], "b p (h d) -> b p h d", h=self.n_heads),
                            hook=None,
                        ),
                        "b p h d -> b p (h d)",
                    ),
                )
            )
            for name, fn in hooks
        ]
        try:
            logits = self.model(batch.tokens).logits
        finally:
            for handle in handles:
                handle.remove()
        return decision_margins(logits.float(), batch)

    # --- the single-position recomputation ---------------------------------------------------

    def _groups(self, batch: EventBatch) -> list[tuple[_ExampleCache, Tensor, Tensor]]:
        """The rows of `batch` by example: (its clean pass, the rows, their slots in the pass)."""
        if self.check_record is None and not self._checking:
            self.check(batch)
        contexts = self._contexts(batch)
        by_example: dict[int, list[int]] = {}
        for row, event in enumerate(batch.events):
            by_example.setdefault(event.example_id, []).append(row)
        groups = []
        for example_id, rows in by_example.items():
            positions = [int(batch.predict_positions[r]) for r in rows]
            cache = self._cache_for(example_id, contexts[example_id], positions)
            slots = [cache.positions.index(p) for p in positions]
            groups.append((cache, torch.tensor(rows), torch.tensor(slots)))
        return groups

    def _run(
        self,
        groups: list[tuple[_ExampleCache, Tensor, Tensor]],
        n: int,
        start: int,
        layer_hooks: dict[int, list[Callable]],
        z_leaves: dict[int, Tensor] | None = None,
        residuals: list[Tensor] | None = None,
        stop: int | None = None,
    ) -> Float[Tensor, "n vocab"] | None:
        """Logits at `n` events (row `rows` of each group is slot `slots` of its example's clean
        pass), recomputed from layer `start` with `layer_hooks[l]` applied to hook_z
        [n, 1, head, d_head]; `z_leaves[l]` is added to hook_z (for gradients). `residuals`
        collects the residual entering each layer from `start` on, then the last layer's output;
        with `stop`, layers from `stop` on are not run and nothing is returned."""
        adapter = self.adapter
        first = groups[0][0].resid
        x = torch.empty(n, first.shape[-1], dtype=first.dtype, device=first.device)
        positions = torch.empty(n, dtype=torch.long, device=first.device)
        for cache, rows, slots in groups:
            x[rows] = cache.resid[start, slots]
            positions[rows] = torch.tensor(cache.positions, device=first.device)[slots]
        for layer in range(start, self.n_layers if stop is None else stop):
            sites = layer_hooks.get(layer, {})
            x = self._apply_hooks(layer, "hook_resid_pre", sites, x)
            if residuals is not None:
                residuals.append(x)
            q, k, v = adapter.qkv(layer, x, positions)
            q = einops.rearrange(q, "n (k g) d -> n k g d", g=self.n_heads // k.shape[1])
            # each event attends to its example's earlier positions (clean keys and values) and to
            # its own, recomputed, key and value
            own = self._scores(layer, einops.einsum(q, k, "n k g d, n k d -> n k g")[..., None])
            z = torch.empty_like(q)
            for cache, rows, _ in groups:
                keys, values = cache.keys[layer], cache.values[layer]
                scores = self._visible(layer, q[rows], keys, positions[rows], include_own=False)
                weights = torch.cat([scores, own[rows]], dim=-1).float().softmax(dim=-1)
                weights = weights.to(q.dtype)
                z[rows] = (
                    einops.einsum(weights[..., :-1], values, "n k g t, k t d -> n k g d")
                    + weights[..., -1:] * v[rows, :, None, :]
                )
            z = einops.rearrange(z, "n k g d -> n (k g) d")
            if z_leaves is not None:
                z = z + z_leaves[layer]
            z = self._apply_hooks(layer, "attn.hook_z", sites, z)
            x = x + self._apply_hooks(layer, "hook_attn_out", sites, adapter.attn_out(layer, z))
            x = x + self._apply_hooks(layer, "hook_mlp_out", sites, adapter.mlp_out(layer, x))
            x = self._apply_hooks(layer, "hook_resid_post", sites, x)
        if stop is not None:
            return None
        if residuals is not None:
            residuals.append(x)
        return adapter.unembed(x)

    def _scores(self, layer: int, raw: Tensor) -> Tensor:
        """Attention scores from query . key products."""
        return raw * self.adapter.scaling(layer)

    def _visible(
        self, layer: int, q: Tensor, keys: Tensor, positions: Tensor, include_own: bool
    ) -> Float[Tensor, "n kv group t"]:
        """Scores of queries `q` [n, kv, group, d] at `positions` over the clean `keys` [kv, t, d],
        -inf where the layer hides a key: later positions (and the own one unless `include_own`),
        and keys outside a sliding window."""
        scores = self._scores(layer, einops.einsum(q, keys, "n k g d, k t d -> n k g t"))
        t = torch.arange(keys.shape[1], device=keys.device)[None, :]
        visible = t <= positions[:, None] if include_own else t < positions[:, None]
        window = self.adapter.window(layer)
        if window is not None:
            visible = visible & (t > positions[:, None] - window)
        return scores.masked_fill(~visible[:, None, None, :], float("-inf"))

    def _apply_hooks(
        self, layer: int, site: str, sites: dict[str, list[Callable]], act: Tensor
    ) -> Tensor:
        """The hooks on `site` of `layer` applied to the events' activations `act` [n, ...], seen
        as [n, 1, ...] (one position each), under TransformerLens's contract: called as
        ``fn(activation, hook=point)``; one returning None keeps the (maybe in-place edited)
        activation."""
        if site not in sites:
            return act
        name = f"blocks.{layer}.{site}"
        point = self._hook_points.get(name) or SimpleNamespace(name=name, layer=lambda: layer)
        view = act[:, None].clone()  # an in-place hook must not write into the shared recomputation
        for fn in sites[site]:
            returned = fn(view, hook=point)
            if returned is None:
                continue
            if not isinstance(returned, Tensor) or returned.shape != view.shape:
                shape = tuple(returned.shape) if isinstance(returned, Tensor) else type(returned)
                raise EngineUnsupported(
                    f"a hook on {name} returned {shape} for activations {tuple(view.shape)}"
                )
            view = returned
        return view[:, 0]

    def margins(
        self,
        batch: EventBatch,
        hooks_for: Callable[[EventBatch], Sequence[HookPair]],
        chunk: int | None = None,
    ) -> Float[Tensor, "event"]:
        """Each event's margin with `hooks_for(view)`'s hooks applied, `view` being the
        event-position view of each chunk of rows (see the module docstring)."""
        return self._chunked_margins(batch, lambda view, rows: hooks_for(view), chunk)

    def differentiable_margins(
        self, batch: EventBatch, hooks_for: Callable[[EventBatch], Sequence[HookPair]]
    ) -> Float[Tensor, "event"]:
        """:meth:`margins` with their autograd graph: gradients reach the parameters the hooks
        use (a learned mask's gates), through the single-position recomputation. The graph of
        every row is held until the caller's backward: take at most `grad_rows` rows at once."""
        return self._chunked_margins(batch, lambda view, rows: hooks_for(view), grad=True)

    def layer_sweep(
        self, batch: EventBatch, means, layer: int, heads: Sequence[int]
    ) -> Float[Tensor, "head event"]:
        """Margins with each of `heads` of `layer` mean-ablated alone, at every event: one
        batched recomputation from `layer` for all (head, event) pairs."""
        n = len(batch)
        row_heads = torch.tensor(list(heads)).repeat_interleave(n)

        def hooks_for(view: EventBatch, rows: Tensor) -> list[HookPair]:
            classes = event_position_classes(view, means.class_names)
            return row_head_ablation_hooks(self, layer, row_heads[rows], means, classes)

        repeated = batch.select(torch.arange(n).repeat(len(heads)))
        return self._chunked_margins(repeated, hooks_for).view(len(heads), n)

    def _chunked_margins(
        self,
        batch: EventBatch,
        hooks_for: Callable[[EventBatch, Tensor], Sequence[HookPair]],
        chunk: int | None = None,
        grad: bool = False,
    ) -> Float[Tensor, "event"]:
        """Margins over `batch` in chunks of rows, `hooks_for(view, rows)` building each chunk's
        hooks (`rows`: the chunk's row indices into `batch`); each chunk is recomputed from its
        first hooked layer (no hooks: the last layer, which gives the clean margin). With `grad`,
        the margins keep their autograd graph (to whatever the hooks read that requires grad).

        Rows are taken example by example (:func:`example_major`), so each example's clean pass
        is run once per call even when the cache cannot hold every example: callers repeat the
        events once per head or head set, and chunks in that order would cycle through all the
        examples each time, evicting every pass before its next use."""
        order = example_major(batch)
        margins = []
        with torch.enable_grad() if grad else torch.no_grad():
            for span in row_chunks(len(batch), chunk or self.chunk):
                rows = order[span.start : span.stop]
                sub = batch.select(rows)
                view = event_view(sub)
                layer_hooks = self._layer_hooks(hooks_for(view, rows))
                start = min(layer_hooks, default=self.n_layers - 1)
                logits = self._run(self._groups(sub), len(sub), start, layer_hooks).float()
                margins.append(row_margins(logits, view))
        if not margins:
            return torch.empty(0)
        return torch.cat(margins)[torch.argsort(order)]  # back to the batch's order

    def residuals(
        self,
        batch: EventBatch,
        hooks_for: Callable[[EventBatch], Sequence[HookPair]] | None = None,
        stages: int | None = None,
    ) -> Float[Tensor, "stage event d_model"]:
        """The residual stream at each row's predicting position before every layer and after
        the last (`resid_pre` 0..L-1, then `resid_post` L-1), with `hooks_for(view)`'s hooks
        applied; `stages` keeps only the first that many."""
        stages = self.n_layers + 1 if stages is None else stages
        out = []
        with torch.no_grad():
            for rows in row_chunks(len(batch), self.chunk):
                sub = batch.select(list(rows))
                groups = self._groups(sub)
                layer_hooks = self._layer_hooks(hooks_for(event_view(sub)) if hooks_for else [])
                start = min(min(layer_hooks, default=stages), self.n_layers - 1)
                clean = torch.empty(start, len(sub), groups[0][0].resid.shape[-1])
                for cache, group_rows, slots in groups:
                    clean[:, group_rows] = cache.resid[:start, slots].float().cpu()
                recomputed: list[Tensor] = []
                if start < stages:
                    stop = None if stages > self.n_layers else stages
                    self._run(groups, len(sub), start, layer_hooks, residuals=recomputed, stop=stop)
                later = [r.float().cpu() for r in recomputed]
                out.append(torch.cat([clean, *(r[None] for r in later)])[:stages])
        return torch.cat(out, dim=1)

    def _layer_hooks(self, hooks: Sequence[HookPair]) -> dict[int, dict[str, list[Callable]]]:
        """Hooks by layer and site; a hook point the engine cannot apply at single positions
        raises EngineUnsupported (the caller may then run the full forward)."""
        if hasattr(self.model, "hook_dict"):
            check_hook_names(self.model, [name for name, _ in hooks])
        layer_hooks: dict[int, dict[str, list[Callable]]] = {}
        for name, fn in hooks:
            match = _HOOK_NAME.match(name)
            if match is None:
                raise EngineUnsupported(
                    f"the engine applies hooks on blocks.L.{{{', '.join(_SITES)}}} only, not {name!r}"
                )
            layer, site = int(match.group(1)), match.group(2)
            if site != "attn.hook_z" and not self.adapter.residual_hooks:
                raise EngineUnsupported(
                    f"the engine's {type(self.adapter).__name__} applies hook_z only, not {name!r}"
                )
            if layer >= self.n_layers:
                raise KeyError(f"unknown hook name {name!r}: the model has {self.n_layers} layers")
            layer_hooks.setdefault(layer, {}).setdefault(site, []).append(fn)
        return layer_hooks

    def event_z(self, batch: EventBatch) -> Float[Tensor, "layer event head d_head"]:
        """Clean hook_z at each event's predicting position (knock-in sources), float32."""
        out = torch.empty(self.n_layers, len(batch), self.n_heads, self.adapter.d_head)
        for cache, rows, slots in self._each_example(batch):
            out[:, rows] = cache.z[:, slots].float().cpu()
        return out

    def attribution(self, batch: EventBatch, means) -> Float[Tensor, "event layer head"]:
        """Gradient x (activation - class mean) of each event's margin per head, as
        :func:`mistill_lens.lens.margins.attribution_scores` computes it on the full forward, from
        one single-position recomputation through every layer with a backward pass."""
        scores = torch.empty(len(batch), self.n_layers, self.n_heads)
        class_index = torch.tensor([means.class_index(kind) for kind in batch.kinds])
        order = example_major(batch)  # each example's clean pass once, as in _chunked_margins
        for span in row_chunks(len(batch), self.grad_rows):
            rows = order[span.start : span.stop]
            sub = batch.select(rows)
            groups = self._groups(sub)
            dtype, device = groups[0][0].z.dtype, groups[0][0].z.device
            leaves = {
                layer: torch.zeros(
                    len(sub), self.n_heads, self.adapter.d_head, dtype=dtype, device=device
                ).requires_grad_()
                for layer in range(self.n_layers)
            }
            with torch.enable_grad():
                logits = self._run(groups, len(sub), 0, {}, z_leaves=leaves).float()
                grads = torch.autograd.grad(
                    row_margins(logits, event_view(sub)).sum(), list(leaves.values())
                )
            act = self.event_z(sub)
            mean = einops.rearrange(means.means[class_index[rows]].float(), "n l h d -> l n h d")
            grad = torch.stack(grads).float().cpu()
            scores[rows] = einops.einsum(grad, act - mean, "l n h d, l n h d -> n l h")
        return scores

    def set_margins(self, batch: EventBatch, means, masks: Tensor) -> Float[Tensor, "set event"]:
        """Margins with head set `masks[s]` [layer, head] jointly mean-ablated, for every set and
        event: one batched recomputation of all (set, event) pairs."""
        n = len(batch)
        row_masks = masks.repeat_interleave(n, dim=0)

        def hooks_for(view: EventBatch, rows: Tensor) -> list[HookPair]:
            classes = event_position_classes(view, means.class_names)
            return row_set_ablation_hooks(self, row_masks[rows], means, classes)

        repeated = batch.select(torch.arange(n).repeat(len(masks)))
        return self._chunked_margins(repeated, hooks_for).view(len(masks), n)

    def sweep_groups(self, heads: Sequence[Head]) -> list[list[Head]]:
        """Heads swept together: a layer's in one batched recomputation."""
        by_layer: dict[int, list[Head]] = {}
        for head in heads:
            by_layer.setdefault(head[0], []).append(head)
        return list(by_layer.values())

    def sweep_blocks(self, batch: EventBatch) -> list[Int[Tensor, "row"]]:
        """`batch`'s rows in blocks of whole examples whose clean passes fit the cache together
        (estimated from the first example's pass, by context length): a sweep that takes every
        head group through one block before the next runs each pass once, where going through
        all events per group would run every pass again for each group once they stop fitting."""
        runs = example_runs(batch)
        contexts = self._contexts(batch)
        self.prepare(batch.select(runs[0]))
        sample = self._caches[batch.events[int(runs[0][0])].example_id]
        per_token = sample.n_bytes / len(sample.tokens)
        blocks: list[list[Tensor]] = []
        used = float("inf")
        for rows in runs:
            size = per_token * len(contexts[batch.events[int(rows[0])].example_id])
            if used + size > 0.9 * self.cache_bytes:  # the estimate's margin
                blocks.append([])
                used = 0.0
            blocks[-1].append(rows)
            used += size
        return [torch.cat(block) for block in blocks]

    def sweep_heads(
        self, batch: EventBatch, means, heads: Sequence[Head]
    ) -> Float[Tensor, "head event"]:
        """Margins with each of `heads` (one layer's: a group of :meth:`sweep_groups`) ablated
        alone."""
        layers = {layer for layer, _ in heads}
        if len(layers) != 1:
            raise ValueError(f"sweep_heads takes one layer's heads (a sweep group), got {heads}")
        return self.layer_sweep(batch, means, layers.pop(), [h for _, h in heads])

    def event_rows(
        self, batch: EventBatch, layers: Sequence[int]
    ) -> dict[int, Float[Tensor, "event head key"]]:
        """:meth:`event_patterns` of each of `layers`: no [T, T] pattern at all."""
        return {layer: self.event_patterns(batch, layer) for layer in layers}

    def residuals_at(
        self,
        batch: EventBatch,
        positions: Tensor,
        hooks_for: Callable[[EventBatch], Sequence[HookPair]] | None = None,
    ) -> Float[Tensor, "k stage event d_model"]:
        """The residual stream at `positions` [k, event] (earlier positions of the rows' contexts),
        every stage, with `hooks_for`'s hooks acting there: every k in one call, so each example's
        clean pass is made once for all its positions."""
        k = len(positions)
        every_k = EventBatch(
            batch.tokens.repeat(k, 1),
            positions.flatten(),
            batch.chosen.repeat(k),
            batch.contrast.repeat(k, 1),
            list(batch.events) * k,
        )
        return einops.rearrange(self.residuals(every_k, hooks_for), "s (k e) d -> k s e d", k=k)

    def head_means(self, batch: EventBatch, class_names: Sequence[str]) -> HeadMeans:
        """Per-class means of hook_z at the rows' predicting positions (class: each position's
        class among `class_names`), from the clean passes: no forward over the rows."""
        position_class = event_position_classes(batch, class_names)
        classes = position_class[torch.arange(len(batch)), batch.predict_positions]
        one_hot = torch.nn.functional.one_hot(classes, len(class_names)).double()
        sums = einops.einsum(one_hot, self.event_z(batch).double(), "e c, l e h d -> c l h d")
        return class_means(class_names, sums, one_hot.sum(dim=0).long())

    def event_patterns(self, batch: EventBatch, layer: int) -> Float[Tensor, "event head pos"]:
        """Clean attention of each head of `layer` from each event's predicting position over its
        context (zero-padded to the longest), computed for those rows alone: no [T, T] pattern."""
        width = int(batch.predict_positions.max()) + 1
        out = torch.zeros(len(batch), self.n_heads, width)
        adapter = self.adapter
        with torch.no_grad():
            for cache, rows, slots in self._each_example(batch):
                positions = torch.tensor(cache.positions)[slots]
                q, _, _ = adapter.qkv(layer, cache.resid[layer, slots], positions)
                keys = cache.keys[layer]
                q = einops.rearrange(q, "n (k g) d -> n k g d", g=self.n_heads // keys.shape[0])
                scores = self._visible(layer, q, keys, positions, include_own=True)
                pattern = einops.rearrange(scores.float().softmax(-1), "n k g t -> n (k g) t")
                # the clean pass may reach past this batch's rows (an example's later events)
                span = min(keys.shape[1], width)
                out[rows, :, :span] = pattern[..., :span].cpu()
        return out


def example_major(batch: EventBatch) -> Int[Tensor, "event"]:
    """The row order that takes `batch`'s examples one after another (in the order each first
    appears), keeping each example's rows in their order."""
    first: dict[int, int] = {}
    for event in batch.events:
        first.setdefault(event.example_id, len(first))
    keys = torch.tensor([first[e.example_id] for e in batch.events], dtype=torch.long)
    return torch.sort(keys, stable=True).indices


def example_runs(batch: EventBatch) -> list[Int[Tensor, "row"]]:
    """`batch`'s rows example by example (:func:`example_major` order), one tensor per example."""
    if len(batch) == 0:
        return []
    order = example_major(batch)
    ids = torch.tensor([batch.events[i].example_id for i in order.tolist()], dtype=torch.long)
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    return list(torch.split(order, counts.tolist()))


def event_view(batch: EventBatch) -> EventBatch:
    """The events of `batch` with one position each (their predicting position, now 0): what the
    engine's hooks see. Factories given this view build hooks for activations [n, 1, head, d]."""
    rows = torch.arange(len(batch))
    return EventBatch(
        batch.tokens[rows, batch.predict_positions][:, None],
        torch.zeros(len(batch), dtype=torch.long),
        batch.chosen,
        batch.contrast,
        batch.events,
    )


def _zero_heads_hooks(batch: EventBatch, heads: list) -> list[tuple[str, Callable]]:
    """hook_z hooks zeroing `heads` at each row's predicting position (the self-check's
    intervention: it needs no reference means)."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)

    def zero(heads_of_layer):
        def fn(act, hook):
            act = act.clone()
            rows = torch.arange(act.shape[0])
            for head in heads_of_layer:
                act[rows, batch.predict_positions, head] = 0.0
            return act

        return fn

    return [(z_hook_name(layer), zero(hs)) for layer, hs in sorted(by_layer.items())]


def _cache_tensors(cache, n_layers: int) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer keys and values [kv_head, T, d_head] of a transformers cache of batch 1."""
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:  # older transformers: key_cache / value_cache lists
        pairs = list(zip(cache.key_cache, cache.value_cache))
    if len(pairs) != n_layers:
        raise EngineUnsupported(f"the model's cache has {len(pairs)} layers, expected {n_layers}")
    return [k[0] for k, _ in pairs], [v[0] for _, v in pairs]
