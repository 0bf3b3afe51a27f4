"""Shampoo (purejax/optim/shampoo.py, shampoo_blocks.py, matrix_roots.py) against a float64 numpy reference of
the same algorithm, written here independently: loops over layers and blocks, blocks cut without padding (the
last one smaller, as the paper's partitioner cuts them), roots by float64 `eigh`. Also: Adam before the start
(optax), the roots on ill-conditioned matrices, a checkpoint round trip, errors; and on 8 simulated devices (this
file run as a child process, `python test_shampoo.py OUT.json`, XLA_FLAGS set by the fixture) the shared-out
roots, a data-parallel `sharded_train_step` and FSDP slices, each against one device, with the collectives of
the compiled step."""

import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax import checkpoint, optim
from purejax import tree as tree_lib
from purejax.optim.matrix_roots import inverse_pth_root, inverse_pth_roots
from tests.children import child_results

# A padded matrix (10 x 6 in blocks of 4), a 1-D leaf, stacked layers (2 x 5 x 3, and per-layer scales that
# are 1-D), a 3-D kernel merged to (6, 4), and a matrix over max_dim (16): every kind of leaf.
SHAPES = {"w": (10, 6), "b": (6,), "blocks": {"w": (2, 5, 3), "scale": (2, 3)}, "conv": (3, 2, 4), "wide": (3, 20)}
SETTINGS = dict(block_size=4, precondition_every=3, start_preconditioning_step=4, max_dim=16, stacked=("blocks",))


def random_tree(shapes, seed, lead=()):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.normal(size=(*lead, *s)).astype(np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


# --- the reference: numpy, float64, one block at a time ---------------------------------------------------------


def ref_root(a, p, eps):
    w, v = np.linalg.eigh(a)
    if w.max() <= 0:
        return np.eye(len(a))
    return (v * (np.maximum(w, 0) + eps * w.max()) ** (-1.0 / p)) @ v.T


def ref_shampoo(
    grads,
    *,
    block_size,
    precondition_every,
    start_preconditioning_step,
    max_dim,
    stacked,
    graft,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    stats_decay=0.999,
    matrix_eps=1e-5,
    inverse_root=4,
):
    """The updates of every step, for `grads` a {path: (steps, *shape)} dict."""
    steps = next(iter(grads.values())).shape[0]
    mu = {k: 0.0 for k in grads}
    nu = {k: 0.0 for k in grads}
    stats, roots, out = {}, {}, {k: [] for k in grads}
    for t in range(1, steps + 1):
        preconditioning = t - 1 >= start_preconditioning_step
        recompute = preconditioning and (t - 1 - start_preconditioning_step) % precondition_every == 0
        for k, g_all in grads.items():
            g = g_all[t - 1].astype(np.float64)
            mu[k] = b1 * mu[k] + (1 - b1) * g
            nu[k] = b2 * nu[k] + (1 - b2) * g**2
            m = mu[k] / (1 - b1**t)
            gr = m / (np.sqrt(nu[k] / (1 - b2**t)) + eps) if graft == "adam" else m
            n_layer_axes = sum(k == s or k.startswith(s + ".") for s in stacked)
            per_layer = g.shape[n_layer_axes:]
            rows = int(np.prod(per_layer[:-1])) if len(per_layer) >= 2 else 0
            if len(per_layer) < 2 or max(rows, per_layer[-1]) > max_dim:
                out[k].append(gr)
                continue
            update = np.empty_like(g)
            for layer in np.ndindex(g.shape[:n_layer_axes]):
                gm, mm = g[layer].reshape(rows, -1), m[layer].reshape(rows, -1)
                d = np.zeros_like(mm)
                for i in range(0, gm.shape[0], block_size):
                    for j in range(0, gm.shape[1], block_size):
                        key, blk = (k, layer, i, j), gm[i : i + block_size, j : j + block_size]
                        lft, rgt = stats.get(key, (0.0, 0.0))
                        w = 1.0 if stats_decay == 1 else 1 - stats_decay
                        stats[key] = (stats_decay * lft + w * blk @ blk.T, stats_decay * rgt + w * blk.T @ blk)
                        if recompute:
                            roots[key] = tuple(ref_root(s, inverse_root, matrix_eps) for s in stats[key])
                        if preconditioning:
                            pl, pr = roots[key]
                            d[i : i + block_size, j : j + block_size] = (
                                pl @ mm[i : i + block_size, j : j + block_size] @ pr
                            )
                gl = gr[layer].reshape(rows, -1)
                scaled = d * np.linalg.norm(gl) / np.linalg.norm(d) if preconditioning else gl
                update[layer] = scaled.reshape(per_layer)
            out[k].append(update)
    return {k: np.stack(v) for k, v in out.items()}


# --- purejax, jitted over all steps ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("settings",))
def run(grads, settings):
    tx = optim.scale_by_shampoo(**dict(settings))
    params = jax.tree.map(lambda g: g[0], grads)

    def body(state, g):
        updates, state = tx.update(g, state, params)
        return state, updates

    return jax.lax.scan(body, tx.init(params), grads)[1]


def frozen(**kwargs):
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))


@pytest.mark.parametrize("graft, stats_decay", [("adam", 0.99), ("sgd", 1.0)])
def test_matches_float64_reference_over_30_steps(graft, stats_decay):
    grads = random_tree(SHAPES, seed=0, lead=(30,))
    got = run(grads, frozen(**SETTINGS, graft=graft, stats_decay=stats_decay))
    want = ref_shampoo(tree_lib.flatten(grads), **SETTINGS, graft=graft, stats_decay=stats_decay)
    for path, g in tree_lib.flatten(got).items():
        w = want[path]
        err = np.abs(np.asarray(g, np.float64) - w).max(axis=tuple(range(1, w.ndim)))
        scale = np.abs(w).max(axis=tuple(range(1, w.ndim)))
        # 1e-5 measured with the Adam graft: float32's `1 - b2**t` (as optax's) loses digits; 6e-7 with SGD's
        assert (err <= 2e-5 * scale + 1e-7).all(), (path, (err / scale).max())
    # the preconditioned steps really differ from the graft's: the comparison tests the preconditioning
    graft_only = ref_shampoo(tree_lib.flatten(grads), **{**SETTINGS, "start_preconditioning_step": 99}, graft=graft)
    assert np.abs(graft_only["w"][10:] - want["w"][10:]).max() > 0.1 * np.abs(want["w"][10:]).max()


def test_is_adam_until_preconditioning_starts(parity):
    """With the start beyond the run, `shampoo` with the Adam graft is Adam: optax's, an independent reference."""
    parity(ours_adam, optax.adam, {"learning_rate": 1e-2}, steps=20)


def ours_adam(learning_rate):
    return optim.shampoo(learning_rate, 4, start_preconditioning_step=1000)


# --- the roots ---------------------------------------------------------------------------------------------------


def spd(n, cond, seed):
    """A random symmetric positive-definite matrix with eigenvalues spread evenly in log from 1/cond to 1."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return ((q * np.logspace(-np.log10(cond), 0, n)) @ q.T).astype(np.float32)


@pytest.mark.parametrize("n, cond, eps", [(16, 10, 1e-5), (16, 1e12, 1e-4), (16, 1e12, 1e-6), (64, 1e8, 1e-5)])
def test_root_matches_float64_eigh_within_the_stated_bound(n, cond, eps):
    """Ill-conditioned inputs included; the bound is the module's `2 sqrt(n) u / (p eps)` (u = 6e-8), at
    least float32 rounding of a well-conditioned result. The input is rounded to float32 for both."""
    a = np.stack([spd(n, cond, seed) for seed in range(3)])
    got = np.asarray(inverse_pth_root(jnp.asarray(a), 4, eps), np.float64)
    for g, x in zip(got, a):
        want = ref_root(x.astype(np.float64), 4, eps)
        err = np.linalg.norm(g - want, 2) / np.linalg.norm(want, 2)
        assert err < max(2 * np.sqrt(n) * 6e-8 / (4 * eps), 1e-5), err


def test_root_of_singular_and_zero_statistics():
    g = np.random.default_rng(0).normal(size=(8, 2))
    singular = (g @ g.T).astype(np.float32)  # rank 2: six eigenvalues are rounding noise around 0, some negative
    got = np.asarray(inverse_pth_root(jnp.asarray(singular), 2, 1e-4), np.float64)
    want = ref_root(singular.astype(np.float64), 2, 1e-4)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want, 2) < 1e-2 * np.linalg.norm(want, 2)
    np.testing.assert_array_equal(inverse_pth_root(jnp.zeros((2, 3, 3)), 4), np.broadcast_to(np.eye(3), (2, 3, 3)))


def test_roots_of_many_sizes_equal_one_at_a_time():
    mats = [jnp.asarray(np.stack([spd(k, 100, s) for s in range(b)])) for k, b in [(3, 2), (5, 1), (3, 4)]]
    for got, m in zip(inverse_pth_roots(mats, 4), mats):
        np.testing.assert_allclose(got, inverse_pth_root(m, 4), rtol=1e-6, atol=1e-6)


def test_roots_are_computed_only_under_the_recompute_cond():
    tx = optim.scale_by_shampoo(4, **{k: v for k, v in SETTINGS.items() if k != "block_size"})
    grads = random_tree(SHAPES, seed=0)
    jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(grads)).jaxpr
    assert eigh_shapes([e for e in jaxpr.eqns if e.primitive.name != "cond"]) == []
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert [eigh_shapes(b.jaxpr.eqns) != [] for c in conds for b in c.params["branches"]].count(True) == 1


# --- state, checkpoint, errors -----------------------------------------------------------------------------------


def test_state_paths_are_named():
    tx = optim.shampoo(1e-3, **SETTINGS)
    paths = list(tree_lib.flatten(tx.init(random_tree(SHAPES, 0))))
    assert "shampoo.stats.left.w" in paths and "shampoo.preconditioners.right.blocks.w" in paths
    assert "shampoo.nu.b" in paths and "shampoo.stats.left.b" not in paths  # the graft alone: no statistics
    state = tx.init(random_tree(SHAPES, 0))["shampoo"]
    assert state.stats.left["blocks"]["w"].shape == (2, 2, 1, 4, 4)  # (layer, row blocks, col blocks, 4, 4)
    assert state.stats.right["w"].shape == (3, 2, 4, 4)  # 10 x 6 in blocks of 4: padded to 12 x 8
    assert state.stats.left["wide"] is None and state.stats.right["conv"].shape == (2, 1, 4, 4)  # conv: 6 x 4


def test_checkpoint_round_trip_continues_bit_for_bit(tmp_path):
    """Saved halfway (between two recomputations of the roots), restored, continued: the same bits as a run
    straight through. The SGD graft's state has a None (`nu`) besides the statistics."""
    tx = optim.shampoo(1e-2, **SETTINGS, graft="sgd", weight_decay=0.1)

    @jax.jit
    def steps(params, opt_state, grads):
        def body(carry, g):
            updates, s = tx.update(g, carry[1], carry[0])
            return (optim.apply_updates(carry[0], updates), s), None

        return jax.lax.scan(body, (params, opt_state), grads)[0]

    params, grads = random_tree(SHAPES, 1), random_tree(SHAPES, 2, lead=(12,))
    first, second = jax.tree.map(lambda g: g[:6], grads), jax.tree.map(lambda g: g[6:], grads)
    straight = steps(*steps(params, tx.init(params), first), second)
    halfway = steps(params, tx.init(params), first)
    checkpoint.save(tmp_path / "ckpt.msgpack", {"params": halfway[0], "opt_state": halfway[1]}, step=6)
    restored, _ = checkpoint.restore(tmp_path / "ckpt.msgpack", like={"params": halfway[0], "opt_state": halfway[1]})
    resumed = steps(restored["params"], restored["opt_state"], second)
    assert jax.tree.structure(resumed) == jax.tree.structure(straight)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 0}, "block_size must be an int of at least 1"),
        ({"precondition_every": 0}, "precondition_every"),
        ({"start_preconditioning_step": -1}, "start_preconditioning_step"),
        ({"inverse_root": 0}, "inverse_root"),
        ({"max_dim": 0}, "max_dim"),
        ({"graft": "lion"}, "graft must be 'adam' or 'sgd'"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optim.scale_by_shampoo(**kwargs)


def test_a_stacked_prefix_on_a_scalar_is_named():
    with pytest.raises(ValueError, match=r"stacked=\('blocks',\)\): blocks.n has shape \(\)"):
        optim.scale_by_shampoo(stacked=("blocks",)).init({"blocks": {"n": jnp.zeros(())}})


# --- distributed: 8 simulated devices in a child process ---------------------------------------------------------


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"}
    return child_results(__file__, tmp_path_factory.mktemp("shampoo"), env=env)


def test_distributed_equals_one_device(distributed):
    assert distributed["max_abs_diff"] <= 1e-6 * distributed["max_abs"], distributed


def test_data_parallel_train_step_equals_one_device(distributed):
    """`sharded_train_step` on a dp=8 mesh, the state placed by `state_specs` (all replicated), 6 steps. The
    error relative to the distance moved is the gradient sum's rounding (8 partial sums, not one) amplified by
    the roots: 8e-6 measured, the same without `axis_name`, and 8e-8 for AdamW in the same test."""
    assert distributed["state_specs"] == ["P()"]
    assert distributed["train_rel_err"] < 1e-4, distributed


def test_distributed_splits_the_roots_with_one_all_gather(distributed):
    # 32 statistics of 4 x 4 and 4 of 3 x 3 (CHILD_SHAPES): each of 8 devices takes 4 and 1 (padded up)
    assert sorted(distributed["eigh_single"]) == [[4, 3, 3], [32, 4, 4]]
    assert sorted(distributed["eigh_per_device"]) == [[1, 3, 3], [4, 4, 4]]
    assert distributed["collectives"] == {"all-gather@data": {"ops": 1, "elements": 8 * (4 * 16 + 1 * 9)}}


def test_fsdp_slices_equal_one_device(distributed):
    """Params split over the data axis (rows, columns, a conv kernel's first dim, stacked layers): each device
    preconditions its slice's blocks; the grafting norms are one all-reduce of 10 scalars (XLA combines the
    psums), the replicated matrix's roots one all-gather. `state_specs` splits the statistics' block grid."""
    assert distributed["fsdp_max_abs_diff"] <= 1e-6 * distributed["fsdp_max_abs"], distributed
    assert distributed["fsdp_stats_spec"] == "P(None, 'data')"
    assert distributed["fsdp_collectives"] == {
        "all-gather@data": {"ops": 1, "elements": 8 * 16},  # rep (6, 5): 8 statistics of 4 x 4, one per device
        "all-reduce@data": {"ops": 1, "elements": 10},  # 2 norms each of w, v, conv, and of 2 layers of blocks.w
    }


def test_fsdp_slices_that_are_not_whole_blocks_are_named(distributed):
    error = distributed["fsdp_misaligned_error"]
    assert "blocks.w (2, 32, 8) is split (None, 'data')" in error and "holds 4 x 8 of its 32 x 8 matrix" in error
    assert "pick a block_size dividing the slice" in error


CHILD_SHAPES = {"w": (16, 12), "b": (6,), "blocks": {"w": (2, 5, 3)}, "conv": (3, 2, 4)}
CHILD_SETTINGS = dict(block_size=4, precondition_every=2, start_preconditioning_step=1, stacked=("blocks",))


def eigh_shapes(eqns, lead=()) -> list:
    """The shape of the matrices of every eigh among a jaxpr's equations, nested ones included: a batch, or the
    length of the `lax.map` (a scan) it runs under (one matrix at a time, as on CPU: matrix_roots._eigh)."""
    found = []
    for eqn in eqns:
        if eqn.primitive.name == "eigh":
            found.append([*lead, *eqn.invars[0].aval.shape])
        inner_lead = (*lead, eqn.params["length"]) if eqn.primitive.name == "scan" else lead
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += eigh_shapes(inner.eqns, inner_lead)
    return found


def child(out: str) -> None:
    from jax.sharding import PartitionSpec as P

    from purejax import parallel
    from tests.purejax.parallel.hlo import executed_collectives

    assert jax.device_count() == 8, jax.devices()
    mesh = parallel.make_mesh(8, 1)
    grads = random_tree(CHILD_SHAPES, seed=0, lead=(7,))
    single = run(grads, frozen(**CHILD_SETTINGS))
    tx = optim.scale_by_shampoo(**CHILD_SETTINGS, axis_name="data")

    def steps(grads):
        params = jax.tree.map(lambda g: g[0], grads)
        return jax.lax.scan(lambda s, g: tx.update(g, s)[::-1], tx.init(params), grads)[1]

    sharded = jax.jit(jax.shard_map(steps, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=True))
    diff = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(sharded(grads)), jax.tree.leaves(single))]
    g0 = jax.tree.map(lambda g: g[0], grads)
    one_step = jax.shard_map(lambda g, s: tx.update(g, s), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=True)
    counts = executed_collectives(jax.jit(one_step).lower(g0, tx.init(g0)).compile().as_text(), {"data": 8, "model": 1})
    single_tx = optim.scale_by_shampoo(**CHILD_SETTINGS)
    results = {
        "max_abs_diff": max(diff),
        "max_abs": max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(single)),
        "collectives": {f"{kind}@{'+'.join(axes)}": n for (kind, axes), n in counts.items()},
        "eigh_single": eigh_shapes(jax.make_jaxpr(single_tx.update)(g0, single_tx.init(g0)).jaxpr.eqns),
        "eigh_per_device": eigh_shapes(jax.make_jaxpr(one_step)(g0, tx.init(g0)).jaxpr.eqns),
    }
    results.update(train_step_check(mesh))
    results.update(fsdp_check(mesh))
    Path(out).write_text(json.dumps(results))


def train_step_check(mesh) -> dict:
    """A linear least-squares model trained 6 steps by `sharded_train_step` (dp=8) and by `train_step`."""
    from jax.sharding import PartitionSpec as P

    from purejax import parallel

    def loss_fn(axis_name):
        def loss(params, batch, key):
            x, y = batch
            sq = jnp.sum(jnp.square(x @ params["w"] + params["b"] - y))
            n = jnp.asarray(y.size, jnp.float32)
            if axis_name is not None:
                sq, n = jax.lax.psum(sq, axis_name), jax.lax.psum(n, axis_name)
            return sq / n, {}

        return loss

    params = random_tree({"w": (12, 6), "b": (6,)}, seed=3)
    rng = np.random.default_rng(4)
    batches = [(rng.normal(size=(16, 12)).astype(np.float32), rng.normal(size=(16, 6)).astype(np.float32))] * 6
    settings = dict(block_size=4, precondition_every=2, start_preconditioning_step=2)
    single_opt, dp_opt = optim.shampoo(0.05, **settings), optim.shampoo(0.05, **settings, axis_name="data")
    state = optim.init_train_state(params, single_opt, jax.random.key(0))
    step = jax.jit(functools.partial(optim.train_step, loss_fn=loss_fn(None), optimizer=single_opt))
    specs = parallel.state_specs(state, jax.tree.map(lambda _: P(), params))
    dp_state = parallel.shard(state, specs, mesh)
    dp_step = parallel.sharded_train_step(mesh, specs, P("data"), loss_fn=loss_fn("data"), optimizer=dp_opt)
    for batch in batches:
        state, _ = step(state, batch)
        dp_state, _ = dp_step(dp_state, batch)
    got, want = np.asarray(dp_state.params["w"], np.float64), np.asarray(state.params["w"], np.float64)
    return {
        "state_specs": sorted({str(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))}),
        "train_rel_err": float(np.linalg.norm(got - want) / np.linalg.norm(want - np.asarray(params["w"]))),
    }


def fsdp_check(mesh) -> dict:
    """Params split over the data axis on their rows (w, blocks.w, a conv kernel's first dim) or columns (v),
    others replicated (rep, b): Shampoo on each device's slices, state placed by `state_specs`, 7 steps."""
    from jax.sharding import PartitionSpec as P

    from purejax import parallel
    from tests.purejax.parallel.hlo import executed_collectives

    shapes = {
        "w": (32, 12),
        "v": (12, 32),
        "blocks": {"w": (2, 32, 8)},
        "conv": (8, 2, 4, 6),
        "rep": (6, 5),
        "b": (12,),
    }
    specs = {
        "w": P("data"),
        "v": P(None, "data"),
        "blocks": {"w": P(None, "data")},
        "conv": P("data"),
        "rep": P(),
        "b": P(),
    }
    settings = dict(block_size=4, precondition_every=2, start_preconditioning_step=1, stacked=("blocks",))
    grads = random_tree(shapes, seed=5, lead=(7,))
    single = run(grads, frozen(**settings))
    tx = optim.scale_by_shampoo(**settings, axis_name="data", param_specs=specs)
    state = tx.init(jax.tree.map(lambda g: g[0], grads))
    state_specs = parallel.state_specs(state, specs)
    stepped = jax.tree.map(lambda s: P(None, *s), specs, is_leaf=lambda x: isinstance(x, P))

    def steps(state, grads):
        return jax.lax.scan(lambda s, g: tx.update(g, s)[::-1], state, grads)[1]

    sharded = jax.jit(jax.shard_map(steps, mesh=mesh, in_specs=(state_specs, stepped), out_specs=stepped))
    got = sharded(parallel.shard(state, state_specs, mesh), grads)
    one = jax.shard_map(lambda s, g: tx.update(g, s)[0], mesh=mesh, in_specs=(state_specs, specs), out_specs=specs)
    hlo = jax.jit(one).lower(state, jax.tree.map(lambda g: g[0], grads)).compile().as_text()
    counts = executed_collectives(hlo, {"data": 8, "model": 1})
    bad = optim.scale_by_shampoo(**{**settings, "block_size": 8}, axis_name="data", param_specs=specs)
    try:
        jax.eval_shape(
            jax.shard_map(lambda s, g: bad.update(g, s)[0], mesh=mesh, in_specs=(state_specs, specs), out_specs=specs),
            state,
            jax.tree.map(lambda g: g[0], grads),
        )
        error = ""
    except ValueError as e:
        error = str(e)
    return {
        "fsdp_max_abs_diff": max(
            float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(single))
        ),
        "fsdp_max_abs": max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(single)),
        "fsdp_stats_spec": str(state_specs.stats.left["blocks"]["w"]),
        "fsdp_collectives": {f"{kind}@{'+'.join(axes)}": n for (kind, axes), n in counts.items()},
        "fsdp_misaligned_error": error,
    }


if __name__ == "__main__":
    child(sys.argv[1])
