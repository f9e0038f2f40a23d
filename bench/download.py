"""Download throughput from an S3 server on loopback: vllm-reloader's fetch vs boto3's
transfer manager, on the same objects, in the same run, alternating rounds.

Not a timed test: it prints each round and the median ratio (ours / boto3). Ours does more
per byte (blake3 of every file while streaming, fsync, journal for resume), so a ratio
near or above 1 means that work is hidden behind the transfer.

    .venv/bin/python bench/download.py [--mb 256] [--files 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import blake3


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="total size of the checkpoint")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--part-mb", type=int, default=16)
    args = parser.parse_args(argv)

    import boto3
    from boto3.s3.transfer import TransferConfig
    from moto.server import ThreadedMotoServer

    from vllm_reloader.checkpoint.manifest import Manifest, ManifestFile, dumps
    from vllm_reloader.sources.download import Plan, fetch
    from vllm_reloader.sources.objstore import Store

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    size = args.mb * 1_000_000 // args.files
    entries = []
    for i in range(args.files):
        data = os.urandom(size)
        name = f"model-{i:05d}.safetensors"
        client.put_object(Bucket="bench", Key=f"runs/ckpt/{name}", Body=data)
        entries.append(ManifestFile(path=name, size=size, blake3=blake3.blake3(data).hexdigest()))
    manifest = Manifest(format_version=1, files=tuple(entries))
    store = Store("s3://bench/runs", endpoint_url=endpoint)
    part = args.part_mb << 20
    plan = Plan(concurrency=args.concurrency, part_size=part, min_free_bytes=0)
    boto_config = TransferConfig(
        max_concurrency=args.concurrency, multipart_chunksize=part, multipart_threshold=part
    )
    total = size * args.files
    ours, theirs = [], []
    scratch = Path(tempfile.mkdtemp(prefix="vllm-reloader-bench-"))
    try:
        listed, _ = store.list()
        listing = {e.path: listed[f"ckpt/{e.path}"] for e in entries}

        def run_ours() -> None:
            fetch(
                store, "ckpt", ("manifest.json", dumps(manifest)), manifest, listing,
                staging_root=scratch / "staging", root=scratch / "ours", plan=plan,
            )  # fmt: skip

        def run_boto3() -> None:
            (scratch / "boto3").mkdir()
            for entry in entries:
                target = str(scratch / "boto3" / entry.path)
                client.download_file("bench", f"runs/ckpt/{entry.path}", target, Config=boto_config)

        for round_ in range(args.rounds):
            # Alternate who goes first, so neither always gets the warmer server.
            turns = [(run_ours, ours, "ours"), (run_boto3, theirs, "boto3")]
            for runner, speeds, output in turns[:: -1 if round_ % 2 else 1]:
                started = time.perf_counter()
                runner()
                speeds.append(total / (time.perf_counter() - started) / 1e6)
                shutil.rmtree(scratch / output)
            print(
                f"round {round_ + 1}: ours {ours[-1]:.0f} MB/s, boto3 {theirs[-1]:.0f} MB/s", file=sys.stderr
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        server.stop()
    result = {
        "benchmark": "download",
        "bytes": total,
        "files": args.files,
        "concurrency": args.concurrency,
        "part_bytes": part,
        "ours_mb_per_s": round(statistics.median(ours), 1),
        "boto3_mb_per_s": round(statistics.median(theirs), 1),
        "ratio": round(statistics.median(o / t for o, t in zip(ours, theirs, strict=True)), 3),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
