"""Helpers that write tuning profiles for the chooser and profile tests."""

import json

import torch

from blockdiag import profile


def entry(measurements, settings=None, device="cpu", dtype=torch.float32, torch_version=None):
    return {
        "device_name": profile.device_name(device),
        "device": device,
        "torch": torch_version or torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "created": "2026-01-01T00:00:00+00:00",
        "threads": 2,
        "settings": settings or {},
        "measurements": measurements,
    }


def point(mode="forward", batch=256, groups=50, block_in=10, block_out=10, **times):
    return {"mode": mode, "batch": batch, "groups": groups, "block_in": block_in, "block_out": block_out,
            "times_us": times}


def write(path, *entries, version=1):
    doc = {"format": profile.FORMAT, "version": version, "entries": {}}
    for e in entries:
        doc["entries"][f"{e['device_name']}|{e['torch']}|{e['dtype']}"] = e
    path.write_text(json.dumps(doc))
    profile.clear_cache()
    return path
