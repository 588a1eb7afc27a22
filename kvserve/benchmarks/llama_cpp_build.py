"""Build (once) and cache llama.cpp's `llama-server` from the sources vendored in the
`llama-cpp-python` sdist: CPU only, the vector ISAs this CPU reports, no BLAS, no
curl/OpenSSL, no web UI.

The cache directory is $KVSERVE_LLAMA_CPP_DIR, else ~/.cache/kvserve/llama.cpp; a
finished build leaves `bin/llama-server` and `build-info.json` there and reruns skip
the build.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time

from kvserve import envs

logger = logging.getLogger(__name__)

SDIST_PACKAGE = "llama-cpp-python"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_BLAS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_OPENMP=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)


# /proc/cpuinfo flag -> ggml option. Named instead of -march=native (GGML_NATIVE), which also
# turns on AMX where the CPU reports it: that build died with a general-protection fault
# right after starting its thread pool on an AMX Xeon VM, where this set runs.
_ISA_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                "avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI"}


def isa_cmake_flags(cpu_flags: set[str] | None) -> list[str]:
    """ggml's ISA options for a CPU with these /proc/cpuinfo flags; None (no /proc/cpuinfo,
    e.g. macOS): -march=native."""
    if cpu_flags is None:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF"] + [
        f"-D{option}={'ON' if flag in cpu_flags else 'OFF'}" for flag, option in _ISA_OPTIONS.items()
    ]


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cache_dir() -> str:
    return str(envs.KVSERVE_LLAMA_CPP_DIR)


def server_binary(directory: str | None = None) -> str:
    return os.path.join(directory or cache_dir(), "bin", "llama-server")


def cached_server() -> str | None:
    path = server_binary()
    return path if os.access(path, os.X_OK) else None


def _run(command: list[str], log_path: str, cwd: str | None = None) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        result = subprocess.run(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[:4])} ...` failed (exit {result.returncode}); see {log_path}")


def build_llama_server(jobs: int | None = None) -> str:
    """The cached llama-server, building it first when absent; returns its path."""
    directory = cache_dir()
    if (path := cached_server()) is not None:
        return path
    os.makedirs(directory, exist_ok=True)
    log_path = os.path.join(directory, "build.log")
    start = time.perf_counter()
    sdists = glob.glob(os.path.join(directory, "llama_cpp_python-*.tar.gz"))
    if not sdists:
        logger.info("downloading the %s sdist into %s", SDIST_PACKAGE, directory)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              SDIST_PACKAGE, "-d", directory], log_path)
        sdists = glob.glob(os.path.join(directory, "llama_cpp_python-*.tar.gz"))
    sdist = sorted(sdists)[-1]
    source_root = os.path.join(directory, "src")
    shutil.rmtree(source_root, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        archive.extractall(source_root, members=members, filter="data")
    (source,) = glob.glob(os.path.join(source_root, "*", "vendor", "llama.cpp"))
    build = os.path.join(directory, "build")
    shutil.rmtree(build, ignore_errors=True)
    jobs = jobs or os.cpu_count() or 1
    logger.info("building llama-server (%d jobs, log %s); a 2-core machine takes several minutes",
                jobs, log_path)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    cmake_flags = [*CMAKE_FLAGS, *isa_cmake_flags(_cpu_flags())]
    _run(["cmake", "-S", source, "-B", build, *generator, *cmake_flags], log_path)
    _run(["cmake", "--build", build, "--target", "llama-server", "-j", str(jobs)], log_path)
    os.makedirs(os.path.join(directory, "bin"), exist_ok=True)
    shutil.copy2(os.path.join(build, "bin", "llama-server"), server_binary(directory))
    seconds = time.perf_counter() - start
    shutil.rmtree(build, ignore_errors=True)  # the binary is static: the cache keeps only it and the sdist
    shutil.rmtree(source_root, ignore_errors=True)
    with open(os.path.join(directory, "build-info.json"), "w") as f:
        json.dump({"sdist": os.path.basename(sdist), "cmake_flags": cmake_flags,
                   "jobs": jobs, "build_seconds": round(seconds, 1)}, f, indent=2)
    logger.info("llama-server built in %.0f s: %s", seconds, server_binary(directory))
    return server_binary(directory)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(build_llama_server())
