"""Where a training run's arrays live and how its step runs: one device, or a (dp, tp) mesh (with context
parallelism a (dp, cp, tp) one, with pipeline parallelism pp stages of it) over the devices of one or
several processes (docs/parallelism.md, docs/multihost.md).

    devices = Devices(dp=2, tp=2, fsdp=False, num_processes=1)
    devices.start()                        # first, before any other JAX call
    params_specs = gpt_parallel.param_specs(model, devices.axes, devices.mesh.shape)
    state, state_specs = devices.build_state(lambda: new_state(...), params_specs)   # one compiled program
    step = devices.train_step(state_specs, loss_fn=..., optimizer=...)
    rows = devices.local_rows(global_batch_size)         # the rows of every batch this process reads
    batch = devices.put_batch(get_batch(..., rows=rows), global_batch_size)

With dp = tp = 1 in one process there is no mesh: the state stays where JAX puts it and the step is the plain
`jax.jit(train_step)`, exactly the single-device program. Otherwise every process runs the same sharded step
(`purejax.parallel.sharded_train_step`, which sums the data shards' gradients once per step); the batch is
split over the data axis and each process reads only the rows its own devices hold. With cp > 1 each row
is also split over the context axis, in zig-zag order (`put_batch` reorders it; purejax/parallel/context.py).
With pp > 1 the batch is replicated over the pipe axis (stage 0 reads the tokens, the last stage the targets).
"""

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from purejax import optim, parallel
from purejax.parallel import context, distributed, preemption

PyTree = Any
CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class Devices:
    """The devices a run uses: `dp` data-parallel groups of `tp` tensor-parallel devices (with `fsdp`, the
    params and optimizer state also split over the data groups), each group `cp` times over for context
    parallelism (the sequence split over a ring), the whole grid `pp` times over for pipeline parallelism
    (each copy holds one stage's layers), over `num_processes` processes."""

    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    num_processes: int = 1
    cp: int = 1
    pp: int = 1
    sp: bool = False  # Megatron sequence parallelism over the tp devices (purejax/parallel/sequence.py)
    ep: bool = False  # expert parallelism: experts split over the data groups (purejax/parallel/experts.py)

    def __post_init__(self):
        if self.sp and self.tp == 1:
            raise ValueError("sp splits the sequence over the tensor-parallel devices, so it needs tp > 1")
        for name in ("dp", "tp", "cp", "pp", "num_processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.fsdp and self.dp == 1:
            raise ValueError("fsdp splits the params over the data-parallel devices, so it needs dp > 1")
        if self.n_devices % self.num_processes:
            raise ValueError(
                f"pp x dp x cp x tp = {self.n_devices} devices cannot be shared evenly by {self.num_processes} "
                "processes"
            )

    @property
    def n_devices(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def sharded(self) -> bool:
        """False for the plain single-device program."""
        return self.n_devices > 1 or self.num_processes > 1

    def start(self, **initialize_kwargs: Any) -> None:
        """Join the multi-process run (`purejax.parallel.initialize`, a no-op for one process) and, for a CPU
        backend, make each process simulate its share of the dp x tp devices. Must run before any other JAX
        call, since both are fixed when JAX's backend starts.

        The simulated devices (XLA's `--xla_force_host_platform_device_count`) only concern the CPU platform:
        on a GPU or TPU machine the flag changes nothing and the mesh is built from the accelerators. On a
        CPU the devices share one thread pool, so data parallelism over them does not use the cores any
        better than one device does (docs/benchmarks.md); it is for trying a layout before renting a cluster.
        """
        local = self.n_devices // self.num_processes
        flags = os.environ.get("XLA_FLAGS", "")
        if self.sharded and CPU_DEVICES_FLAG not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {CPU_DEVICES_FLAG}={local}".strip()
        distributed.initialize(**initialize_kwargs)

    @functools.cached_property
    def mesh(self) -> jax.sharding.Mesh:
        return parallel.make_mesh(self.dp, self.tp, cp=self.cp, pp=self.pp)

    @property
    def axes(self) -> parallel.MeshAxes:
        """The axes the model runs under; `MeshAxes()` (one device) when not sharded."""
        if not self.sharded:
            return parallel.MeshAxes()
        return parallel.MeshAxes.of(self.mesh, fsdp=self.fsdp, sp=self.sp, ep=self.ep)

    @property
    def batch_spec(self) -> P:
        """Rows over the data axis, each row's tokens over the context axis; P(None, None): a 1 x tp mesh
        gives every device the whole batch."""
        return P(self.axes.data, self.axes.context)

    def build_state(
        self, make_state: Callable[..., optim.TrainState], param_specs: PyTree | None = None, params: PyTree = None
    ) -> tuple[optim.TrainState, PyTree]:
        """(the state that `make_state()` builds, or `make_state(params)` around given params, its specs).

        The state is computed by one compiled program: run op by op, an initialiser compiles a program per
        operation and shape, dozens for a GPT or a MobileNet (docs/train-gpt.md). On a mesh the program's outputs are
        split as `parallel.state_specs` derives from `param_specs`, so each device computes only its own
        shards (a model too large for one device starts sharded) and every process its own devices'; given
        `params` (an imported model's) are placed on the mesh first. Unsharded, the specs are None."""
        inputs = () if params is None else (params,)

        def new_state(*inputs):  # the program's name in the compile log
            return make_state(*inputs)

        # The state is computed once: on a CPU, XLA's backend optimisations would about double this program's
        # compile time (mostly its random draws) to save milliseconds of its one run (docs/train-gpt.md).
        options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
        if not self.sharded:
            return jax.jit(new_state, compiler_options=options)(*inputs), None
        specs = parallel.state_specs(jax.eval_shape(make_state, *inputs), param_specs)
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))
        if inputs:
            inputs = (parallel.shard(params, param_specs, self.mesh),)
        return jax.jit(new_state, out_shardings=shardings, compiler_options=options)(*inputs), specs

    def train_step(self, state_specs: PyTree | None, **train_step_kwargs: Any) -> Callable:
        """`(state, batch) -> (state, metrics)`: `optim.train_step` jitted (state donated), or sharded."""
        if not self.sharded:
            return jax.jit(functools.partial(optim.train_step, **train_step_kwargs), donate_argnums=0)
        return parallel.sharded_train_step(self.mesh, state_specs, self.batch_spec, **train_step_kwargs)

    def evaluate(self, loss: Callable, param_specs: PyTree | None) -> Callable:
        """`(params, x, y) -> loss` jitted, or under shard_map with the params split as `param_specs` and the
        batch over the data axis; `loss(params, (x, y), axes)` must average over `axes.data` itself."""
        axes = self.axes

        def eval_loss(params, x, y):  # the program's name in the compile log
            return loss(params, (x, y), axes)

        if not self.sharded:
            return jax.jit(eval_loss)
        fn = jax.shard_map(
            eval_loss,
            mesh=self.mesh,
            in_specs=(param_specs, self.batch_spec, self.batch_spec),
            out_specs=P(),
            check_vma=True,
        )
        return jax.jit(fn)

    def local_rows(self, global_batch_size: int) -> range | None:
        """The rows of each global batch that this process loads (None: all of them, unsharded)."""
        if not self.sharded:
            return None
        if global_batch_size % self.dp:
            raise ValueError(
                f"a batch of {global_batch_size} rows cannot be split evenly over dp={self.dp} data-parallel "
                f"groups; make batch_size a multiple of {self.dp}"
            )
        return distributed.local_rows(NamedSharding(self.mesh, P(self.axes.data)), (global_batch_size,))

    def put_batch(self, local: PyTree, global_batch_size: int) -> PyTree:
        """The global batch, as arrays split over the data axis, from this process's rows (`local_rows`); with
        cp > 1 each row reordered (zig-zag) and split over the context axis. Unsharded: `jax.device_put`."""
        if not self.sharded:
            return jax.device_put(local)
        if self.cp > 1:  # each device's tokens next to each other: its two zig-zag chunks of every row
            local = jax.tree.map(
                lambda x: np.take(x, context.ring_order(np.shape(x)[1], self.cp, zigzag=True), 1), local
            )
        return distributed.global_batch(local, self._batch_sharding, global_batch_size)

    @property
    def _batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch_spec)

    def barrier(self, name: str) -> None:
        """Wait until every process gets here (one process: return at once)."""
        if self.num_processes > 1:
            multihost_utils.sync_global_devices(name)

    def stop_agreement(self) -> Callable[[bool, int], bool]:
        """The loop's `agree(requested, it)`: whether to save and stop after iteration `it`, given this
        process's own `requested`. One process: `requested` itself; several: a `StopAgreement`."""
        if self.num_processes == 1:
            return lambda requested, it: requested
        return StopAgreement()


class StopAgreement:
    """Where the processes of one run stop together. Saving is a collective, so every process must stop
    after the same step, whichever of them got the notice: a pod's preemption reaches one host, `scancel`
    or the launcher all of them.

    A SIGTERM goes to JAX's preemption notifier, which `jax.distributed.initialize` installs in place of
    Python's handler; a SIGINT, which Python's handler sees (`requested`), is handed to it once
    (`preemption.notify`). The notifier tells the coordination service, the processes agree on a step a
    little ahead of the furthest one, and each sees True when it gets there (`preemption.reached_sync_point`,
    asked after every step; purejax/parallel/preemption.py): no collective in between, and no wait for the
    device."""

    def __init__(self):
        self.notified = False

    def __call__(self, requested: bool, it: int) -> bool:
        if requested and not self.notified:
            self.notified = True
            preemption.notify()
        return preemption.reached_sync_point(it)


def start_devices(settings: Any) -> Devices:
    """Join the multi-process run if there is one and make the dp x cp x tp devices, from a program's settings
    (`dp`, `tp`, `cp`, `pp`, `fsdp`, `sp`, `ep` if it has one, `coordinator`, `num_processes`, `process_id`);
    before any other JAX call."""
    num_processes = settings.num_processes or distributed.launched_process_count()  # also srun's or mpirun's count
    layout = {name: getattr(settings, name) for name in ("dp", "tp", "cp", "pp", "fsdp", "sp")}
    try:
        devices = Devices(**layout, num_processes=num_processes, ep=getattr(settings, "ep", False))
        devices.start(
            coordinator_address=settings.coordinator or None,
            num_processes=settings.num_processes or None,
            process_id=None if settings.process_id < 0 else settings.process_id,
        )
        if jax.process_count() != num_processes:  # a Cloud TPU pod's runtime joins its workers by itself
            devices = dataclasses.replace(devices, num_processes=jax.process_count())
        if devices.sharded:
            devices.mesh  # noqa: B018 - builds the mesh now, so a wrong device count fails before any work
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return devices
