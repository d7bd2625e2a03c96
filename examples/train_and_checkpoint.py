"""Train a small model with plain JAX and a Grain data loader; checkpoint by step, time and preemption.

    python examples/train_and_checkpoint.py --root ./train_ckpt --steps 30 --every 10
    python examples/train_and_checkpoint.py --root ./ckpt2 --steps 30 --every 10 --stop-after 25
    python examples/train_and_checkpoint.py --root ./ckpt2 --steps 30 --every 10  # resumes at 20
    kill -TERM <pid>     # a preemption: saves the next step, waits for it, exits 0

Runs on 8 simulated CPU devices (no accelerator needed). What each part shows:

* State: ``{"params", "opt_state": {"mu", "nu", "count"}, "rng", "step"}`` -- an MLP regressing a
  synthetic function, a hand-written Adam, a typed PRNG key split every step (dropout) and
  the step counter as a Python int (kept exactly in the checkpoint's manifest).
* Data: a Grain pipeline (shuffled, batched); its iterator's position is saved with each step
  as a ``dio.PerProcess`` item, so a resumed run sees exactly the batches an uninterrupted one
  would (each step prints a digest of its batch).
* Policies: save every ``--every`` steps, every ``--save-seconds`` seconds, and at preemption
  (SIGTERM); keep the latest ``--keep`` steps and the ``--best`` with the lowest loss.
* FSDP: every weight, bias and Adam moment is split row-wise over the mesh axis 'data' (each
  device stores 1/8 of it), as is the batch; XLA gathers a weight where it is used.
* ``train_step`` is jitted with ``donate_argnums`` for params and opt_state: their buffers are
  reused for the new values, so a buffer must not be donated while a save still reads it.
* ``manager.save(step, state, priority=priority, on_transfer_end=guard.on_transfer_end)``:
  params and the key are SYNC (the default), off the devices when ``save()`` returns, so the next
  step donates them at once. opt_state is LOW: copied to host after ``save()`` returned, while the
  trainer goes on; ``DonationGuard`` holds the next step (the one that donates it) until
  ``on_transfer_end`` fired for each of its leaves, and the script prints how long that was.
* Restart: the latest committed step is restored onto the same FSDP shardings
  (``manager.restore(target=abstract_state)``), the loader is put back where it was, and
  training goes on; the ``step N loss X`` lines are bit-identical to those of an
  uninterrupted run. ``--stop-after K`` stops after step K (saves already handed to the
  manager are finished first; one killed mid-save would never be listed).
"""

import argparse
import hashlib
import os
import threading
import time

# Before jax is imported: expose 8 CPU devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import grain  # noqa: E402

import dispatch_io as dio  # noqa: E402
from dispatch_io import policies  # noqa: E402

SIZES, BATCH, DROPOUT = [16, 256, 256, 8], 64, 0.1   # MLP widths; the target has 8 outputs
LR, B1, B2, EPS = 3e-3, 0.9, 0.999, 1e-8               # Adam
BUDGET = 128 << 10  # host bytes the IO may hold: small on purpose, so LOW leaves trail behind

mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
FSDP, REPLICATED = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())


def init(key):
    keys = jax.random.split(key, len(SIZES))
    params = {f"layer{i}": {"w": jax.random.normal(k, (n, m)) * np.sqrt(2 / n), "b": jnp.zeros(m)}
              for i, (k, n, m) in enumerate(zip(keys, SIZES, SIZES[1:]))}
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "opt_state": {"mu": zeros, "nu": zeros, "count": jnp.zeros((), jnp.int32)},
            "rng": keys[-1]}


# Shapes without computing anything; arrays split row-wise where the rows divide over 8 devices.
shapes = jax.eval_shape(init, jax.random.key(0))
shardings = jax.tree.map(lambda s: FSDP if s.ndim and s.shape[0] % 8 == 0 else REPLICATED, shapes)
init_state = jax.jit(init, out_shardings=shardings)
# The restore target: shape, dtype and sharding of every array; the Python step as a placeholder.
abstract_state = {**jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings),
                  "step": 0}


def forward(params, x, drop_key):
    for i in range(len(SIZES) - 1):
        x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        if i < len(SIZES) - 2:
            keep = jax.random.bernoulli(jax.random.fold_in(drop_key, i), 1 - DROPOUT, x.shape)
            x = jnp.where(keep, jax.nn.relu(x) / (1 - DROPOUT), 0.0)
    return x


def example(index):
    """Example ``index`` of the synthetic dataset: an input and the function to learn at it."""
    x = np.random.default_rng(index).standard_normal(SIZES[0]).astype(np.float32)
    return {"x": x, "y": np.sin(3 * x[:SIZES[-1]]) * x[SIZES[-1]:]}


def loader():
    """The data pipeline: shuffled examples in batches; its iterator's state is a small dict."""
    return iter(grain.MapDataset.range(1 << 20).shuffle(seed=7).map(example).batch(BATCH).to_iter_dataset())


def train_step(params, opt, rng, x, y):
    rng, drop_key = jax.random.split(rng)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((forward(p, x, drop_key) - y) ** 2))(params)
    count = opt["count"] + 1
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, opt["mu"], grads)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, opt["nu"], grads)
    t = count.astype(jnp.float32)
    params = jax.tree.map(lambda p, m, v: p - LR * (m / (1 - B1 ** t)) / (jnp.sqrt(v / (1 - B2 ** t)) + EPS),
                          params, mu, nu)
    return params, {"mu": mu, "nu": nu, "count": count}, rng, loss


step_fn = jax.jit(train_step, donate_argnums=(0, 1), in_shardings=(None, None, None, FSDP, FSDP),  # params and opt_state buffers are reused
                  out_shardings=(shardings["params"], shardings["opt_state"], REPLICATED, REPLICATED))


def priority(keypath, spec):
    """params, rng: SYNC (off the devices when save() returns); optimizer state: LOW."""
    return dio.Priority.LOW if keypath.startswith("['opt_state']") else dio.Priority.SYNC


class DonationGuard:
    """The array leaves of the last save that dispatch_io may still read from their devices.

    ``expect(tree)`` before ``save()`` (callbacks may fire before it returns); ``on_transfer_end``
    is the save's callback (it runs on dispatch_io's IO threads); ``wait()`` right before a step
    that donates those buffers blocks until none is pending and returns the seconds it waited.
    ``on_transfer_end`` fires once for every array leaf, also when a save fails, so this never hangs."""

    def __init__(self):
        self._cond = threading.Condition()
        self._pending: set[str] = set()

    def expect(self, tree):
        with self._cond:
            self._pending = {jax.tree_util.keystr(path) for path, leaf in
                             jax.tree_util.tree_leaves_with_path(tree) if isinstance(leaf, jax.Array)}

    def on_transfer_end(self, keypath):
        with self._cond:
            self._pending.discard(keypath)
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def wait(self) -> float:
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: not self._pending)
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="./train_ckpt")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--keep", type=int, default=2, help="keep the latest N steps")
    parser.add_argument("--best", type=int, default=1, help="and the N with the lowest loss")
    parser.add_argument("--save-seconds", type=float, default=900.0, help="also save every T seconds")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to be preempted)")
    parser.add_argument("--stop-after", type=int, default=None, help="simulate a crash after this step")
    args = parser.parse_args()
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    guard, saves, waits = DonationGuard(), [], []

    with dio.LocalDispatcher(host_memory_budget=BUDGET) as dispatcher, \
            dio.CheckpointManager(
                args.root, dispatcher,
                save_policy=policies.EveryNSteps(args.every) | policies.EveryNSeconds(args.save_seconds)
                | policies.Preemption(),
                keep_policy=policies.LatestN(args.keep) | policies.BestN(args.best, metric="loss")) as manager:
        data = loader()
        if manager.latest_step() is None:
            state = {**init_state(jax.random.key(0)), "step": 0}
            print(f"no checkpoint under {args.root}: starting from step 0")
        else:
            t0 = time.perf_counter()
            state = manager.restore(target=abstract_state)  # the latest committed step, FSDP-sharded
            data.set_state(manager.item(state["step"], "data"))   # the loader where that step left it
            w = state["params"]["layer1"]["w"]
            print(f"restored step {state['step']} in {ms(time.perf_counter() - t0)}: params.layer1.w "
                  f"{w.shape} held as {w.sharding.shard_shape(w.shape)} shards on {len(w.sharding.device_set)} devices")
        params, opt, rng, step = state["params"], state["opt_state"], state["rng"], state["step"]
        print(f"pid {os.getpid()} training", flush=True)

        while step < args.steps and step != args.stop_after:
            waited = guard.wait()  # this step donates opt_state: the last save must be done reading it
            if saves and saves[-1][0] == step:
                waits.append(waited)
                print(f"  step {step + 1} waited {ms(waited)} for the LOW optimizer state of step {step} "
                      "to leave the devices before donating it")
            batch = next(data)
            params, opt, rng, loss = step_fn(params, opt, rng, batch["x"], batch["y"])
            step += 1
            digest = hashlib.sha256(batch["x"].tobytes()).hexdigest()[:12]
            print(f"step {step} loss {float(loss)!r} batch {digest}", flush=True)
            time.sleep(args.step_seconds)
            if manager.should_save(step):   # every --every steps, every --save-seconds, or preempted
                state = {"params": params, "opt_state": opt, "rng": rng, "step": step}
                guard.expect(state)
                t0 = time.perf_counter()
                handle = manager.save(step, state, items={"data": dio.PerProcess(data.get_state())},
                                      metrics={"loss": loss}, priority=priority, on_transfer_end=guard.on_transfer_end)
                blocked = time.perf_counter() - t0
                saves.append((step, handle))
                print(f"  saved step {step}: save() blocked {ms(blocked)}; "
                      f"{guard.pending()} LOW leaves still being copied")
            if manager.reached_preemption(step):
                print(f"preempted: saved step {step}, stopping")
                break
        if step == args.stop_after:
            print(f"stopping after step {step} (simulated crash); saves handed to the manager finish first")
        manager.wait()
        for saved_step, handle in saves:
            stats = handle.wait()
            print(f"  checkpoint {saved_step}: {stats.bytes_written} bytes in {stats.batches} batches, "
                  f"committed after {ms(stats.total_seconds)}")
        if waits:
            print(f"waited {ms(sum(waits))} in all before donating ({len(waits)} checkpoints)")
        print(f"committed steps under {args.root}: {manager.all_steps()}")

    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(params))).hexdigest()
    print(f"params sha256 {digest}")
    print("OK")


if __name__ == "__main__":
    main()
