"""Weight sync: what a new policy version costs to deliver, per transport, after real optimizer steps.

1. ``--steps`` AdamW steps of the trainer's own ``Learner`` (backend local, fp32 master weights) on
   SmolLM2-135M, full fine-tuning at lr 1e-6 (the setting that learned on CPU, NOTES.md), on
   synthetic batches shaped like logged groups (GRPO groups of 4 with 0/1 rewards, 40-token prompts,
   12-token responses). LoRA is not used: a LoRA trainer ships only its adapters, so "a fraction of
   the full checkpoint" would measure the adapters rather than the delta encoding.
2. disk-delta size of each step's version against the previous one, with disk-delta's own encoder
   (streams/weights/delta.py: changed positions as gaps + changed bits as xor, byte planes, zstd),
   over the full model in bf16 (what the engines hold) and in fp32, as a fraction of the full bytes.
3. The last version in bf16, delivered from this process to two spawned engine processes:
   broadcast (bucketed, gloo over loopback TCP) against a raw ``broadcast`` of one flat buffer of the
   same bytes in the same group, round after round; P2P (ucxx, ``UCX_TLS=tcp`` so both go over
   TCP, or the torch send/recv fallback) to one engine of two tensor-parallel ranks (each rank gets
   its half) and to two single-rank engines; disk and disk-delta through their own sender/receiver.

Times are from the sender starting until the last engine holds the bytes (``*_s``), or has also
verified every checksum (``*_verified_s``); medians over ``--rounds`` after one warm-up round.
``broadcast_ratio`` = raw time / bucketed time (1.0: bucketing costs nothing); ``p2p_vs_broadcast``
= broadcast time / P2P time (> 1: P2P is faster).
The pause (``pause_s_*``) is the time an engine cannot generate: in this system every transport's
``receive`` runs in a worker thread while the engine keeps generating (producers/worker.py), so the
pause is the load that follows (the copy into the engine's bf16 parameters, as
``CpuEngine.update_weights`` does); ``receive_s_*`` says how long the overlapped receive took.

    .venv/bin/python benchmarks/weight_sync.py [--steps 8] [--warmup-steps 2] [--rounds 5] [--bucket-mb 512,64]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from milestream.config import Config
from milestream.streams.weights.broadcast import BroadcastReceiver, BroadcastSender, finish, start_broadcast
from milestream.streams.weights.p2p import P2PReceiver, P2PSender, TorchClient, UcxxClient, ucxx_available

MODEL = "smollm2-135m-instruct"
TIMEOUT_S = 300.0


# ---- the versions --------------------------------------------------------------------------------

def synthetic_batch(rng: random.Random, groups: int = 2, size: int = 4, prompt: int = 40, response: int = 12):
    from milestream.train.learner import CollectedGroup
    from milestream.schemas.records import GroupSample

    batch = []
    for g in range(groups):
        prompt_ids = [rng.randrange(100, 40000) for _ in range(prompt)]
        samples = [GroupSample(f"g{g}/{i}", f"g{g}", f"g{g}", i, size, prompt_ids,
                               [rng.randrange(100, 40000) for _ in range(response)], [1] * response, [0] * response,
                               float(rng.random() < 0.5), "completed", "", "worker-0", "worker-0", 0.0, 0.0,
                               logprobs=[-2.0] * response) for i in range(size)]
        batch.append(CollectedGroup(f"g{g}", samples, 0))
    return batch


def trained_versions(steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The exported weights before the first step and after each one (fp32 copies)."""
    from milestream.train.learner import Learner
    from milestream.infra.model import configure_process

    cfg = Config().with_overrides(model={"name": MODEL, "lora_rank": 0, "threads": os.cpu_count() or 1},
                                  trainer={"lr": 1e-6})
    configure_process(cfg.model)
    learner = Learner(cfg)
    rng = random.Random(seed)
    versions = [{n: t.detach().clone() for n, t in learner.export_weights().items()}]
    for _ in range(steps):
        learner.train_step(synthetic_batch(rng))
        versions.append({n: t.detach().clone() for n, t in learner.export_weights().items()})
    return versions


def delta_fractions(versions: list[dict[str, torch.Tensor]], dtype: torch.dtype, folder: Path) -> dict:
    """Each version as disk-delta's own sender writes it against the one before (its record's num_bytes)."""
    from milestream.streams.weights.delta import DeltaSender

    cfg = Config().with_overrides(run={"run_dir": str(folder / str(dtype))},
                                  weights={"transport": "disk-delta", "full_every": len(versions) + 1})
    sender = DeltaSender(cfg)
    full = sum(t.numel() for t in versions[0].values()) * torch.empty((), dtype=dtype).element_size()
    fractions, changed = [], []
    for version, tensors in enumerate(versions):
        record = sender.publish(NoBroker(), version + 1, version, {n: t.to(dtype) for n, t in tensors.items()})
        if version:  # the first is written in full
            assert record.base_version == version, "disk-delta wrote a full version where a delta was due"
            fractions.append(record.num_bytes / full)
            changed.append(sum(int((t.to(dtype) != versions[version - 1][n].to(dtype)).sum()) for n, t in tensors.items())
                           / sum(t.numel() for t in tensors.values()))
    sender.close()
    return {"fraction": statistics.mean(fractions), "per_step": fractions, "changed_elements": statistics.mean(changed),
            "full_bytes": full}


class NoBroker:
    """The disk transports announce on Kafka; here the record they return is all that is needed."""

    def send(self, spec, records, key=None) -> None:
        pass

    def flush(self, timeout: float = 30.0) -> None:
        pass


# ---- engine processes ----------------------------------------------------------------------------

def stamp_landing(target, method: str) -> None:
    """Record on ``target`` when ``method`` returns: the moment the bytes are in, before verification."""
    inner = getattr(target, method)

    def wrapper(*args, **kwargs):
        out = inner(*args, **kwargs)
        target.landed_at = time.time()
        return out

    setattr(target, method, wrapper)


def engine_main(kind: str, engine_id: str, options: dict, commands, results) -> None:
    """Take commands until told to stop: ("receive", record), or ("raw", bytes) for the baseline."""
    torch.set_num_threads(1)
    if kind == "broadcast":
        receiver = BroadcastReceiver(Config(), engine_id, device="cpu", timeout_s=TIMEOUT_S)
        stamp_landing(receiver, "_receive_broadcast")
        clock = receiver
    else:
        receiver = P2PReceiver(Config(), engine_id, timeout_s=TIMEOUT_S, **options)
        receiver.client = UcxxClient(TIMEOUT_S) if kind == "p2p-ucxx" else TorchClient(TIMEOUT_S)
        stamp_landing(receiver.client, "fetch")
        clock = receiver.client
    params: dict[str, torch.Tensor] | None = None  # the engine's parameters, loaded after each receive
    for command, argument in iter(commands.get, ("stop", None)):
        if command == "raw":
            finish(start_broadcast(receiver.group, torch.empty(argument, dtype=torch.uint8)), "raw broadcast")
            results.put({"landed": time.time()})
            continue
        tensors = receiver.receive(argument)
        returned = time.time()
        if params is None:
            params = {name: torch.empty_like(t) for name, t in tensors.items()}
        started = time.perf_counter()
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
        results.put({"landed": clock.landed_at, "returned": returned, "load_s": time.perf_counter() - started})
    receiver.close()


@contextmanager
def engines(kind: str, members: list[tuple[str, dict]]):
    ctx = mp.get_context("spawn")
    commands = [ctx.Queue() for _ in members]
    results = ctx.Queue()
    procs = [ctx.Process(target=engine_main, args=(kind, engine_id, options, queue, results), daemon=True)
             for (engine_id, options), queue in zip(members, commands)]
    for proc in procs:
        proc.start()
    try:
        yield commands, results
    finally:
        for queue in commands:
            queue.put(("stop", None))
        for proc in procs:
            proc.join(timeout=60)


def timed_round(send, commands, results, command) -> dict:
    """One delivery: every engine is told what to expect, then the sender starts the clock and sends."""
    for queue in commands:
        queue.put(command)
    started = time.time()
    send()
    reports = [results.get(timeout=TIMEOUT_S) for _ in commands]
    return {"s": max(r["landed"] for r in reports) - started,
            "verified_s": max(r.get("returned", r["landed"]) for r in reports) - started,
            "load_s": max(r.get("load_s", 0.0) for r in reports)}


def medians(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def flat_copy(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])


# ---- the transports -------------------------------------------------------------------------------

def broadcast_phase(payload: dict[str, torch.Tensor], bucket_mb: int, rounds: int) -> dict:
    sender = BroadcastSender(Config().with_overrides(weights={"bucket_mb": bucket_mb}), num_engines=2,
                             device="cpu", timeout_s=TIMEOUT_S)
    record, manifest = sender.prepare(1, 1, payload)
    flat = flat_copy(payload)  # the same bytes, already in one buffer: no bucketing, no manifest
    bucketed, raw = [], []
    with engines("broadcast", [("worker-0", {}), ("worker-1", {})]) as (commands, results):
        for index in range(rounds + 1):  # the first round joins the group and touches fresh memory
            one = timed_round(lambda: sender.send(manifest, payload), commands, results, ("receive", record))
            other = timed_round(lambda: finish(start_broadcast(sender.group, flat), "raw broadcast"), commands,
                                results, ("raw", flat.numel()))
            if index:
                bucketed.append(one)
                raw.append(other)
    sender.close()
    return {"bucketed": medians(bucketed), "raw": medians(raw), "buckets": len(manifest.bucket_sizes),
            "bytes": manifest.tensor_bytes}


def p2p_phase(payload: dict[str, torch.Tensor], bucket_mb: int, rounds: int, num_engines: int, tp_size: int,
              use_ucxx: bool) -> dict:
    sender = P2PSender(Config().with_overrides(weights={"bucket_mb": bucket_mb}), num_engines=num_engines,
                       tp_size=tp_size, timeout_s=TIMEOUT_S, use_ucxx=use_ucxx)
    record, staged = sender.prepare(1, 1, payload)
    members = [(f"worker-{e}", {"tp_rank": r, "tp_size": tp_size}) for e in range(num_engines) for r in range(tp_size)]
    done = []
    with engines("p2p-ucxx" if use_ucxx else "p2p-torch", members) as (commands, results):
        for index in range(rounds + 1):
            one = timed_round(lambda: sender.deliver(1, staged), commands, results, ("receive", record))
            if index:
                done.append(one)
    sender.close()
    return {**medians(done), "bytes_sent": sum(p.manifest.tensor_bytes for p in staged.values())}


def disk_phase(previous: dict[str, torch.Tensor], current: dict[str, torch.Tensor], folder: Path, rounds: int) -> dict:
    """One engine (this process) follows versions that alternate between the last two, file by file."""
    from milestream.streams.weights.delta import DeltaReceiver, DeltaSender
    from milestream.streams.weights.disk import DiskReceiver, DiskSender

    out = {}
    for name, sender_cls, receiver_cls in (("disk", DiskSender, DiskReceiver), ("disk_delta", DeltaSender, DeltaReceiver)):
        cfg = Config().with_overrides(run={"run_dir": str(folder / name)})
        sender, receiver = sender_cls(cfg), receiver_cls(cfg, "worker-0")
        params = {n: t.clone() for n, t in previous.items()}  # the engine's model, memory already touched
        receiver.receive(sender.publish(NoBroker(), 1, 1, previous))  # disk-delta's first version is full
        done = []
        for version in range(2, rounds + 2):
            record = sender.publish(NoBroker(), version, version, current if version % 2 == 0 else previous)
            started = time.perf_counter()
            tensors = receiver.receive(record)
            received = time.perf_counter()
            for n, t in tensors.items():
                params[n].copy_(t)
            done.append({"receive_s": received - started, "load_s": time.perf_counter() - received,
                         "bytes": record.num_bytes})
        out[name] = medians(done)
    return out


# ---- the report -----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="steps left out of the steady-state delta figure: AdamW's first steps move every weight "
                             "by about lr (m / sqrt(v) starts at +-1), later ones by less")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", default="512,64", help="the first is the headline, the others extra figures")
    parser.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for the P2P engines ('' lets UCX choose)")
    args = parser.parse_args()
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # inherited by the spawned engines
    bucket_sizes = [int(b) for b in args.bucket_mb.split(",")]
    started = time.monotonic()

    versions = trained_versions(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = delta_fractions(versions, torch.bfloat16, Path(tmp))
        fp32 = delta_fractions(versions, torch.float32, Path(tmp))
        previous, payload = ({n: t.bfloat16() for n, t in v.items()} for v in versions[-2:])
        del versions
        disk = disk_phase(previous, payload, Path(tmp), args.rounds)
    steps_s = time.monotonic() - started
    broadcasts = {mb: broadcast_phase(payload, mb, args.rounds) for mb in bucket_sizes}
    p2p = {(tp_size, use_ucxx): p2p_phase(payload, bucket_sizes[0], args.rounds, 2 // tp_size, tp_size, use_ucxx)
           for use_ucxx in ([True, False] if ucxx_available() else [False]) for tp_size in (2, 1)}
    print(json.dumps(report(args, bf16, fp32, disk, broadcasts, p2p, steps_s, started)))


def report(args, bf16, fp32, disk, broadcasts, p2p, steps_s, started) -> dict:
    headline = broadcasts[int(args.bucket_mb.split(",")[0])]
    bucketed, raw = headline["bucketed"], headline["raw"]
    mb = headline["bytes"] / 2**20
    extra = {f"broadcast_ratio_bucket_{size}mb": b["raw"]["s"] / b["bucketed"]["s"] for size, b in broadcasts.items()}
    p2p_tp2, p2p_tp1 = p2p[(2, ucxx_available())], p2p[(1, ucxx_available())]  # the transport P2P picks itself
    fallback = p2p[(2, False)]
    return {
        "benchmark": "weight_sync", "model": MODEL, "full_bytes_bf16": bf16["full_bytes"],
        "steps": f"{args.steps} AdamW steps of milestream's Learner (local backend, full fine-tuning, lr 1e-6, GRPO) "
                 "on synthetic logged-like batches (2 groups x 4 samples, 40 + 12 tokens, 0/1 rewards)",
        "delta_fraction_bf16": bf16["fraction"], "delta_fraction_fp32": fp32["fraction"],
        "delta_fraction_bf16_steady": statistics.mean(bf16["per_step"][args.warmup_steps:]),
        "delta_fraction_fp32_steady": statistics.mean(fp32["per_step"][args.warmup_steps:]),
        "steady": f"the mean over steps {args.warmup_steps + 1}..{args.steps} (the first {args.warmup_steps} left out)",
        "delta_fraction_bf16_per_step": bf16["per_step"], "changed_elements_bf16": bf16["changed_elements"],
        "changed_elements_fp32": fp32["changed_elements"],
        "delta_encoding": "disk-delta's own DeltaSender (streams/weights/delta.py), weights.delta_encoding sparse: "
                          "changed positions as gaps + xor values, byte planes, zstd; num_bytes of each delta file",
        "broadcast_ratio": raw["s"] / bucketed["s"], "broadcast_ratio_verified": raw["s"] / bucketed["verified_s"],
        **extra, "bucket_mb": int(args.bucket_mb.split(",")[0]), "buckets": headline["buckets"],
        "broadcast_s": bucketed["s"], "broadcast_verified_s": bucketed["verified_s"], "raw_broadcast_s": raw["s"],
        "broadcast_mb_s": mb / bucketed["s"], "raw_broadcast_mb_s": mb / raw["s"],
        "p2p_vs_broadcast": bucketed["s"] / p2p_tp2["s"], "p2p_vs_broadcast_verified": bucketed["verified_s"] / p2p_tp2["verified_s"],
        "p2p_vs_broadcast_two_tp1_engines": bucketed["s"] / p2p_tp1["s"],
        "p2p_vs_broadcast_torch_fallback": bucketed["s"] / fallback["s"],
        "p2p_vs_broadcast_torch_fallback_two_tp1_engines": bucketed["s"] / p2p[(1, False)]["s"],
        "p2p_s": p2p_tp2["s"], "p2p_two_tp1_engines_s": p2p_tp1["s"], "p2p_torch_fallback_s": fallback["s"],
        "p2p_layout": "one engine of tensor parallel 2 (two processes, each gets its shards) vs broadcast of the "
                      "full model to two processes; _two_tp1_engines: two whole-model engines",
        "p2p_transport": (f"ucxx, UCX_TLS={os.environ.get('UCX_TLS', 'default')}" if ucxx_available()
                          else "torch send/recv (gloo), ucxx not installed"),
        "pause_s_broadcast": bucketed["load_s"], "pause_s_p2p": p2p_tp2["load_s"],
        "pause_s_p2p_two_tp1_engines": p2p_tp1["load_s"], "pause_s_disk": disk["disk"]["load_s"],
        "pause_s_disk_delta": disk["disk_delta"]["load_s"],
        "receive_s_broadcast": bucketed["verified_s"], "receive_s_p2p": p2p_tp2["verified_s"],
        "receive_s_disk": disk["disk"]["receive_s"], "receive_s_disk_delta": disk["disk_delta"]["receive_s"],
        "disk_delta_bytes": disk["disk_delta"]["bytes"],
        "pause_definition": "engine blocked = the copy of the received tensors into its bf16 parameters; every "
                            "transport's receive runs off the generation loop (worker thread) and overlaps it",
        "engines": "2 spawned processes, 1 torch thread each; sender in this process; gloo over loopback TCP",
        "cpu_cores": os.cpu_count(), "rounds": args.rounds, "steps_and_delta_s": round(steps_s, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    main()
