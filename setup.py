"""Packaging for verl_dmd: the package plus its hydra config tree and recipes.

The top-level ``config/`` and ``recipes/`` folders ship inside the package as
``verl_dmd.config`` and ``verl_dmd.recipes`` so that a regular (non-editable)
``pip install .`` finds them through ``importlib.resources`` and hydra's
``pkg://`` search path.
"""

from setuptools import find_packages, setup

# Ranges that install together on a CPU machine with Python 3.11 and on the GPU
# machines we benchmark on. torch is deliberately loose: scripts/setup_env.sh
# installs the wheel that fits the machine first (an unpinned torch would pull a
# multi-GB CUDA build onto a CPU box).
INSTALL_REQUIRES = [
    "torch>=2.6,<2.15",
    "verl>=0.9.1,<0.10",
    "ray>=2.40,<3",
    "hydra-core>=1.3.2,<1.4",
    "omegaconf>=2.3,<2.4",
    "diffusers>=0.42.1,<0.43",
    "peft>=0.21.2,<0.22",
    "safetensors>=0.4",
    "numpy>=1.26",
    "scikit-learn>=1.4",  # the embedded digits data set
    # verl-dmd-prepare: the pipelines' text encoders and tokenizers, parquet prompt files, images.
    "transformers>=5,<6",
    "pyarrow>=15",
    "pillow>=10",
    # verl 0.9.1 imports these without declaring them (see ../shared/TRAPS.md).
    "cachetools>=5",
    "uvicorn>=0.20",
]

EXTRAS_REQUIRE = {
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "hypothesis>=6.100",
        # Pinned: formatter output changes between releases and CI checks it.
        "ruff==0.17.6",
        # tests/test_thirdparty_*.py build their fixture packages' wheels with this one, not an isolated
        # copy; 70.1 builds wheels without the separate `wheel` package
        "setuptools>=70.1",
    ],
    # Serving exported students with vllm-omni's DMD2 pipelines. Needs a CUDA
    # build of vllm; never imported at module load.
    "serve": ["vllm-omni>=0.30"],
}

setup(
    name="verl_dmd",
    version="0.1.0.dev0",
    description="Distribution-matching distillation (DMD2) of diffusion models as a verl plugin",
    python_requires=">=3.11",
    packages=[*find_packages(include=["verl_dmd", "verl_dmd.*"]), "verl_dmd.config", "verl_dmd.recipes"],
    package_dir={"verl_dmd.config": "config", "verl_dmd.recipes": "recipes"},
    package_data={
        "verl_dmd.config": ["*.yaml"],
        "verl_dmd.recipes": ["*.yaml"],
        "verl_dmd.assets": ["*/config.json", "*/*.safetensors"],
    },
    include_package_data=False,
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={
        "console_scripts": [
            "verl-dmd = verl_dmd.main:cli",
            "verl-dmd-export = verl_dmd.export_main:cli",
            "verl-dmd-prepare = verl_dmd.prepare_main:cli",
        ],
        # Third-party extensions register in these groups; see docs/architecture.md ("Extending verl_dmd").
        "verl_dmd.adapters": [],
        "verl_dmd.algorithms": [],
        "verl_dmd.data_providers": [],
        "verl_dmd.validators": [],
    },
)
