"""Make no-op stand-ins for the CUDA libraries a torch CUDA wheel links to but
that are not installed (nvidia-* wheels skipped), so `import torch` works on a
CPU-only machine. Every stub function returns 100 (cudaErrorNoDevice)."""
import os, re, subprocess, sys, tempfile, collections
import importlib.util
tdir = os.path.dirname(importlib.util.find_spec("torch").origin)
ldir = os.path.join(tdir, "lib")
sos = [os.path.join(r, f) for r, _, fs in os.walk(tdir) for f in fs if ".so" in f]
run = lambda *a: subprocess.run(a, capture_output=True, text=True).stdout
missing, found = set(), set()
SKIP = {"libcuda.so.1"}  # the driver: only the lazily loaded libcaffe2_nvrtc.so needs it
for so in sos:
    for line in run("ldd", so).splitlines():
        m = re.match(r"\s*(\S+) => (not found|(\S+))", line)
        if m:
            if m[2] != "not found": found.add(m[3])
            elif m[1] not in SKIP: missing.add(m[1])
if not missing:
    print("torch_cuda_stubs: no CUDA library missing"); sys.exit(0)
ver2file = {}
for so in sos:
    cur = None
    for line in run("readelf", "-V", "-W", so).splitlines():
        m = re.search(r"File: (\S+)", line)
        if m: cur = m[1]
        m = re.search(r"Name: (\S+)", line)
        if m and cur in missing: ver2file[m[1]] = cur
defined = set()
for so in sos + sorted(found):
    for line in run("nm", "-D", "--defined-only", so).splitlines():
        p = line.split()
        if len(p) >= 3: defined.add(p[2].split("@")[0])
syms = collections.defaultdict(dict)  # file -> {sym: version or None}
prefix = [("cusparseLt", "libcusparseLt.so.0"), ("cublasLt", "libcublasLt.so.13"), ("nccl", "libnccl.so.2"),
          ("curand", "libcurand.so.10"), ("cuFile", "libcufile.so.0"), ("nvshmem", "libnvshmem_host.so.3"),
          ("cudnn", "libcudnn.so.9"), ("cublas", "libcublas.so.13"), ("cusolver", "libcusolver.so.12"),
          ("cusparse", "libcusparse.so.12"), ("cufft", "libcufft.so.12"), ("nvrtc", "libnvrtc.so.13")]
for so in sos:
    for line in run("nm", "-D", "--undefined-only", so).splitlines():
        p = line.split()
        if len(p) != 2 or p[0] != "U": continue
        name, _, ver = p[1].partition("@")
        ver = ver.lstrip("@")
        if ver:
            if ver in ver2file: syms[ver2file[ver]][name] = ver
        elif name not in defined:
            f = next((f for pre, f in prefix if name.startswith(pre) and f in missing), None)
            if f: syms[f].setdefault(name, None)  # others: Python C API etc.
for f in sorted(missing):
    d = syms.get(f, {})
    with tempfile.TemporaryDirectory() as tmp:
        c, vs = os.path.join(tmp, "s.c"), os.path.join(tmp, "s.map")
        with open(c, "w") as fh:
            for i, n in enumerate(sorted(d)):
                fh.write(f'int s{i}(void) __asm__("{n}");\nint s{i}(void) {{ return 100; }}\n')
        tags = collections.defaultdict(list)
        for n, v in d.items(): tags[v or f].append(n)
        with open(vs, "w") as fh:
            for t, ns in tags.items():
                fh.write(f"{t} {{ global: {'; '.join(ns)}; {'local: *;' if t == f else ''} }};\n")
            if f not in tags: fh.write(f"{f} {{ local: *; }};\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-o", os.path.join(ldir, f), c,
                        f"-Wl,-soname,{f}", f"-Wl,--version-script={vs}"], check=True)
    print(f"stub {f}: {len(d)} symbols")
