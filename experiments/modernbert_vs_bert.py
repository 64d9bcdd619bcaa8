"""ModernBERT-tiny against BERT-tiny at equal parameters, pretrained on the same records (issue 72).

    python -m experiments.modernbert_vs_bert --workdir=W [--lengths=128,512] [--seconds=360,300] \\
        [--seeds=0] [--quick]

Both arms are this project's pretraining code, called in-process (`bert_jax.pretrain.loop.build`,
`steps.train_step` / `eval_step`, `feed.make_train_input` / `make_eval_input` / `run_eval`: what
`python -m bert_jax.main --config=configs/tiny.py` and `--config=configs/modernbert_tiny.py` run),
so that the two arms can alternate in chunks of seconds inside one process:

- BERT-tiny: configs/tiny.py's shape (L=2, H=128, A=2, feed-forward 512, learned positions).
- ModernBERT-tiny: configs/modernbert_tiny.py with the same width, depth and heads, GeGLU of 2/3 of
  BERT's feed-forward (its parameters: 3·H·I' = 2·H·I, benchmarks/step/modernbert_vs_bert.py's rule),
  layer 0 global and layer 1 local with a window of `--local_attention` (default a quarter of the
  length: 32 tokens at 128, 128 at 512).
- The same everything else: masked LM only (BERT with `use_nsp=False`; ModernBERT reads no segment
  ids), dynamic masking at 15% of the tokens (BERT's rate) with the same seed, so both arms draw the
  same batches with the same masks; no dropout (ModernBERT's recipe; BERT's 0.1 set to 0); AdamW
  (b2 0.98, weight decay 0.01, clip 1.0), warmup then a constant rate, float32.

The data: experiments/pretraining_corpus.py's corpus (WikiText-2 raw + Gutenberg + tiny-shakespeare;
shared/data has no WikiText-2 train split, MANIFEST.md) written as records with the released uncased
vocab by `python -m data_pipeline.create_pretraining_data`, one set per length; the held-out records
(the last tenth of the WikiText-2 articles, masks fixed in the records) are the eval set of both arms.

Two comparisons per length and seed, from one run of each arm:
(a) equal wall clock: the arms alternate chunks of `--chunk_seconds` of training (the first arm of
    each round alternates too) until each has trained `--seconds`; compiling and evaluating are not
    counted. The load average is recorded at every chunk (the machine is shared).
(b) equal training FLOPs: after 10 steps each (the last 7 timed), a FLOPs budget F that both arms reach within about
    `--seconds` is fixed, and each arm's step count is F / (its FLOPs per step), by
    `model_family.train_flops_per_sequence` (the model's matmul FLOPs; ModernBERT's local layers count
    their band of keys).
Held-out MLM loss is evaluated at `--evals` marks along both axes (time and FLOPs): the curves.

Then (`--glue_tasks`, experiments/modernbert_vs_bert_glue.py) each arm's state at the equal-time
mark, and the same model at step 0, are saved as pretraining workdirs and fine-tuned on GLUE tasks
with the same settings and seeds: dev scores per seed, mean ± std.

Writes W/modernbert_vs_bert.json and prints the RESULTS.md tables. --quick: a test-sized model
(hidden 32) at length 32 for a few seconds an arm, on the data under --corpus_dir/--vocab_file,
then one epoch of fine-tuning on --glue_train_rows=32 rows at length 32, seeds 1 and 2.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import statistics
import time

from experiments import modernbert_vs_bert_glue as glue
from experiments.pretraining_corpus import CORPUS_DIR, UNCASED_VOCAB, log, stage_corpus, stage_records

ARMS = ("bert", "modernbert")
CALIBRATION_STEPS = 10  # each arm's first steps; the last 7 timed for the FLOPs budget


# ---------------------------------------------------------------------------------------------
# The two configs
# ---------------------------------------------------------------------------------------------


def arm_config(arm: str, args, length: int, seed: int, records: str):
    """configs/tiny.py or configs/modernbert_tiny.py, shaped and trained as the module docstring says."""
    from configs import modernbert_tiny, tiny

    with open(args.vocab_file, encoding="utf-8") as f:
        vocab = [line.rstrip("\n") for line in f]
    config = tiny.get_config() if arm == "bert" else modernbert_tiny.get_config()
    m = config.model
    m.vocab_size = len(vocab)
    m.hidden_size, m.num_hidden_layers, m.num_attention_heads = args.hidden, args.layers, args.heads
    if arm == "bert":
        m.intermediate_size = 4 * args.hidden
        m.max_position_embeddings = length  # as ModernBERT: no unused position rows
        m.hidden_dropout_prob = m.attention_probs_dropout_prob = 0.0
    else:
        m.intermediate_size = (8 * args.hidden) // 3  # GeGLU: 2/3 of BERT's 4H, the same parameters
        m.max_position_embeddings = length
        m.global_attn_every_n_layers = 2  # layer 0 global, layer 1 local (with 2 layers)
        m.local_attention = args.local_attention or length // 4
        m.pad_token_id = vocab.index("[PAD]")
        m.cls_token_id = m.bos_token_id = vocab.index("[CLS]")
        m.sep_token_id = m.eos_token_id = vocab.index("[SEP]")
    config.cpu_bf16 = "off"  # float32 matmuls in both arms
    config.seed = seed
    config.train_data = os.path.join(records, "train", "*.tfrecord*")
    config.eval_data = os.path.join(records, "heldout", "*.tfrecord*")
    config.vocab_file = args.vocab_file
    config.max_seq_length = length
    config.max_predictions_per_seq = predictions(length)
    config.global_batch_size = max(1, args.tokens_per_batch // length)
    config.eval_batch_size = config.global_batch_size
    config.use_nsp = False
    config.objective = "mlm"
    config.dynamic_masking = True
    config.masked_lm_prob = 0.15
    config.packing = False
    config.shuffle_buffer_size = 256 if args.quick else 2_000
    config.optimizer = "adamw"
    config.weight_decay = 0.01
    config.adam_b1, config.adam_b2, config.adam_eps = 0.9, 0.98, 1e-6
    config.clip_norm = 1.0
    config.learning_rate = args.learning_rate
    config.warmup_steps = args.warmup_steps
    config.num_train_steps = 1_000_000  # a time budget, not a step count, ends the run:
    config.lr_decay_steps = 1  # warmup, then the peak rate throughout (no decay before step 999,999)
    config.lr_decay_shape = "polynomial"
    config.google_lr_schedule = False
    config.phases = []
    return config


def predictions(length: int) -> int:
    """Masked positions per row: 15% of the length (20 at 128, 77 at 512)."""
    return max(1, round(0.15 * length + 0.5))


# ---------------------------------------------------------------------------------------------
# One arm: the pretraining loop's pieces, stepped in chunks
# ---------------------------------------------------------------------------------------------


class Arm:
    """One model's train state, jitted (and compiled) steps and input, stepped a chunk at a time."""

    def __init__(self, name: str, config, workdir: str):
        import flax.linen as nn
        import jax

        from bert_jax.model.modeling import count_params
        from bert_jax.pretrain import loop, model_family, startup_checks, steps
        from bert_jax.pretrain.feed import make_eval_input, make_train_input, run_eval
        from bert_jax.pretrain.phases import resolve_phases
        from bert_jax.training import run_setup, sharding

        self.name, self.config = name, config
        os.makedirs(workdir, exist_ok=True)
        self.model_config = run_setup.model_config_from(config, workdir=workdir)
        model_family.check(config, self.model_config)
        phase = resolve_phases(config)[0]
        startup_checks.check_sequence_lengths(config, self.model_config, [phase])
        self.mesh = sharding.create_mesh(config.mesh.to_dict(), config.dcn_mesh.to_dict())
        model, tx, schedule, init_state = loop.build(config, self.model_config, self.mesh)
        abstract = jax.eval_shape(init_state, jax.random.key(config.seed))
        shardings = sharding.logical_to_sharding(abstract, self.mesh, sharding.DEFAULT_RULES)
        self.state, _ = sharding.sharded_init(init_state, jax.random.key(config.seed), self.mesh,
                                              sharding.DEFAULT_RULES)
        self.params = count_params(self.state.params)
        batch_sharding = sharding.batch_sharding(self.mesh)
        train_step = functools.partial(steps.train_step, model=model, tx=tx, schedule=schedule, accum_steps=1,
                                       use_nsp=False, objective="mlm", mesh=self.mesh)
        self._p_train = jax.jit(train_step, in_shardings=(shardings, batch_sharding),
                                out_shardings=(shardings, None), donate_argnums=0)
        p_eval = jax.jit(functools.partial(steps.eval_step, model=model_family.eval_model(self.model_config),
                                           objective="mlm"), in_shardings=(shardings.params, batch_sharding))
        self._context = lambda: _Both(jax.set_mesh(self.mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES))
        self._evaluate = lambda: run_eval(p_eval, self.state.params, make_eval_input(config, config.eval_data),
                                          self.mesh, config.eval_steps)
        special = startup_checks.special_token_ids(config.vocab_file)
        self.batches = make_train_input(config, phase, special)
        self._casing = startup_checks.data_casing([phase])
        self._to_global = lambda b: sharding.to_global(b, self.mesh)
        self.flops_per_step = config.global_batch_size * model_family.train_flops_per_sequence(
            self.model_config, phase.max_seq_length, phase.max_predictions_per_seq)
        self.step, self.seconds, self.step_ok = 0, 0.0, None
        self.batch_digests: list[str] = []  # what the arm trained on, batch by batch
        self.curve: list[dict] = []

    def compile(self) -> float:
        """Compiles the train step at the data's shapes (not counted in the arm's seconds)."""
        started = time.perf_counter()
        self._pending = next(self.batches)
        with self._context():
            self._compiled = self._p_train.lower(self.state, self._to_global(self._pending)).compile()
        return time.perf_counter() - started

    def train_step(self) -> None:
        """One step, timed from fetching its batch to its result."""
        import jax

        started = time.perf_counter()
        batch = self._pending if self._pending is not None else next(self.batches)
        self._pending = None
        self.batch_digests.append(digest(batch))
        with self._context():
            self.state, metrics = self._compiled(self.state, self._to_global(batch))
            jax.block_until_ready(metrics)
        self.seconds += time.perf_counter() - started
        self.step += 1

    def evaluate(self, mark: str) -> dict:
        with self._context():
            result = self._evaluate()
        point = {"mark": mark, "step": self.step, "seconds": round(self.seconds, 2),
                 "flops": self.step * self.flops_per_step, "mlm_loss": float(result["masked_lm_loss"]),
                 "mlm_accuracy": float(result["masked_lm_accuracy"])}
        self.curve.append(point)
        return point

    def save(self, workdir: str) -> dict:
        """The train state as a pretraining workdir (what `bert_jax.main` with configs/tiny.py or
        modernbert_tiny.py leaves: the model files and `checkpoints/<step>/state`), written before
        the next step (which donates the state); not counted in the arm's seconds. A folder of an
        earlier run is replaced (its pretraining is not this one's)."""
        import shutil

        from bert_jax.checkpoints.checkpointer import Checkpointer
        from bert_jax.workdir import write_model_files

        shutil.rmtree(workdir, ignore_errors=True)
        write_model_files(workdir, self.model_config, self.config.vocab_file, self._casing)
        with Checkpointer(os.path.join(workdir, "checkpoints"), save_interval_steps=1, max_to_keep=1,
                          async_save=False, handle_sigterm=False) as ckpt:
            ckpt.save(self.step, self.state, {"step": self.step, "saved_by": "experiments.modernbert_vs_bert"},
                      force=True)
        return {"workdir": workdir, "step": self.step, "encoder_digest": glue.encoder_digest(self.state.params,
                                                                                              self.name)}


class _Both:
    """Two context managers as one."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __enter__(self):
        self.a.__enter__()
        self.b.__enter__()

    def __exit__(self, *exc):
        self.b.__exit__(*exc)
        self.a.__exit__(*exc)


def digest(batch: dict) -> str:
    """A fingerprint of a batch's rows and masks (equal batches: equal digests)."""
    h = hashlib.sha256()
    for key in ("input_ids", "input_mask", "masked_lm_positions", "masked_lm_ids"):
        h.update(batch[key].tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Equal FLOPs and equal seconds
# ---------------------------------------------------------------------------------------------


def equal_flops_steps(flops_per_step: dict, step_seconds: dict, seconds: float) -> dict:
    """Per arm, the steps of a common FLOPs budget: the FLOPs the slower arm (per FLOP) reaches in
    `seconds` at its measured step time, as whole steps of the arm whose steps cost more FLOPs;
    the other arm's steps are that budget over its FLOPs per step, rounded (off by < half a step)."""
    budget = min(seconds / step_seconds[a] * flops_per_step[a] for a in flops_per_step)
    big = max(flops_per_step, key=flops_per_step.get)
    budget = max(1, int(budget // flops_per_step[big])) * flops_per_step[big]
    return {a: max(1, round(budget / f)) for a, f in flops_per_step.items()}


def compare(args, length: int, seed: int, records: str, workdir: str) -> dict:
    """Both arms at one length and seed: (a) equal seconds, (b) equal FLOPs; the curves of both."""
    import jax

    arms = {a: Arm(a, arm_config(a, args, length, seed, records), os.path.join(workdir, a)) for a in ARMS}
    compile_s = {a: round(arm.compile(), 1) for a, arm in arms.items()}
    saved = {a: {} for a in ARMS}  # the arms' pretraining workdirs, for fine-tuning (--glue_tasks)
    for a, arm in arms.items():
        arm.evaluate("start")
        if args.glue_tasks:
            saved[a]["random"] = arm.save(os.path.join(workdir, a, glue.SAVED["random"]))
    loads = []
    # The first steps, alternately: steps 4 to 10 timed (the first ones run slow), the FLOPs budget that fits.
    for k in range(CALIBRATION_STEPS):
        if k == 3:
            before = {a: arm.seconds for a, arm in arms.items()}
        for arm in arms.values():
            arm.train_step()
    step_s = {a: (arm.seconds - before[a]) / (CALIBRATION_STEPS - 3) for a, arm in arms.items()}
    targets = equal_flops_steps({a: arm.flops_per_step for a, arm in arms.items()}, step_s, args.seconds[length])
    total = args.seconds[length]
    marks = {a: {"time": [total * (k + 1) / args.evals for k in range(args.evals)],
                 "flops": sorted({max(1, round(targets[a] * (k + 1) / args.evals)) for k in range(args.evals)})}
             for a in ARMS}
    log(f"length {length} seed {seed}: FLOPs/step {({a: f'{arms[a].flops_per_step:.3g}' for a in ARMS})}, "
        f"first steps {({a: f'{s:.3f}s' for a, s in step_s.items()})}, equal-FLOPs steps {targets}")

    def run_chunk(arm: Arm, budget: float) -> None:
        m = marks[arm.name]
        started = arm.seconds
        while m["time"] or m["flops"]:
            if m["flops"] and arm.step >= m["flops"][0]:
                arm.evaluate(f"flops{len(marks[arm.name]['flops'])}")
                m["flops"].pop(0)
                continue
            if m["time"] and arm.seconds >= m["time"][0]:
                arm.evaluate(f"time{len(m['time'])}")
                m["time"].pop(0)
                if not m["time"] and args.glue_tasks:  # the equal-time mark: the state fine-tuned
                    saved[arm.name]["pretrained"] = arm.save(os.path.join(workdir, arm.name, glue.SAVED["pretrained"]))
                continue
            if arm.seconds - started >= budget:
                return
            arm.train_step()

    round_index = 0
    while any(marks[a]["time"] or marks[a]["flops"] for a in ARMS):
        order = ARMS if round_index % 2 == 0 else ARMS[::-1]
        for a in order:
            loads.append(os.getloadavg()[0])
            run_chunk(arms[a], args.chunk_seconds)
        round_index += 1
    common = min(len(arm.batch_digests) for arm in arms.values())
    same = [arms[ARMS[0]].batch_digests[k] == arms[ARMS[1]].batch_digests[k] for k in range(common)]
    result = {"length": length, "seed": seed, "workdir": workdir,
              "same_batches": {"compared": common, "identical": sum(same)},
              "backend": jax.default_backend(), "compile_s": compile_s, "first_step_s": step_s,
              "equal_flops_steps": targets, "load_average_1min": {
                  "mean": round(statistics.mean(loads), 2), "min": round(min(loads), 2), "max": round(max(loads), 2)},
              "rounds": round_index, "arms": {}}
    for a, arm in arms.items():
        at_time = [p for p in arm.curve if p["mark"].startswith("time")]
        at_flops = [p for p in arm.curve if p["mark"].startswith("flops")]
        mc = arm.model_config
        result["arms"][a] = {
            "params": arm.params, "flops_per_step": arm.flops_per_step,
            "flops_per_token": arm.flops_per_step / (arm.config.global_batch_size * length),
            "batch": arm.config.global_batch_size, "predictions": arm.config.max_predictions_per_seq,
            "shape": {k: getattr(mc, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "intermediate_size", "vocab_size")}
            | ({"local_attention": mc.local_attention} if a == "modernbert" else {}),
            "steps": arm.step, "train_seconds": round(arm.seconds, 2),
            "equal_time": at_time[-1], "equal_flops": at_flops[-1], "curve": arm.curve,
            "batch_digests": arm.batch_digests, "saved": saved[a]}
    return result


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    """RESULTS.md's tables: per length and seed, the end points; then the curves."""
    lines = ["| length | seed | arm | params | FLOPs/token | steps (equal time) | held-out MLM loss, equal time "
             "| steps (equal FLOPs) | held-out MLM loss, equal FLOPs |", "|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for a in ARMS:
            r = run["arms"][a]
            lines.append(f"| {run['length']} | {run['seed']} | {a} | {r['params']:,} "
                         f"| {r['flops_per_token'] / 1e6:.2f} M "
                         f"| {r['equal_time']['step']} ({r['equal_time']['seconds']:.0f} s) "
                         f"| {r['equal_time']['mlm_loss']:.3f} | {r['equal_flops']['step']} "
                         f"({r['equal_flops']['flops'] / 1e12:.2f} TFLOP) | {r['equal_flops']['mlm_loss']:.3f} |")
    lines += ["", "| length | seed | arm | axis | curve: held-out MLM loss at (seconds or TFLOP) |",
              "|---|---|---|---|---|"]
    for run in report["runs"]:
        for a in ARMS:
            curve = run["arms"][a]["curve"]
            for axis, key, scale, unit in (("time", "seconds", 1.0, "s"), ("flops", "flops", 1e-12, "TF")):
                pts = [p for p in curve if p["mark"] == "start" or p["mark"].startswith(axis)]
                text = ", ".join(f"{p['mlm_loss']:.2f} @ {p[key] * scale:.3g}{unit}" for p in pts)
                lines.append(f"| {run['length']} | {run['seed']} | {a} | {axis} | {text} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="records and the report (the records are reused)")
    p.add_argument("--corpus_dir", default=CORPUS_DIR)
    p.add_argument("--vocab_file", default=UNCASED_VOCAB)
    p.add_argument("--lengths", default="128,512")
    p.add_argument("--seconds", default="360,300", help="training seconds per arm, one per length")
    p.add_argument("--seeds", default="0")
    p.add_argument("--chunk_seconds", type=float, default=15.0, help="training seconds per turn of an arm")
    p.add_argument("--evals", type=int, default=4, help="curve points along each axis (time, FLOPs)")
    p.add_argument("--tokens_per_batch", type=int, default=2048,
                   help="batch = this / length (16 rows at 128, 4 at 512)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--local_attention", type=int, default=0, help="ModernBERT's window; 0 = a quarter of the length")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument("--dupe_factor", type=int, default=3)
    p.add_argument("--num_workers", type=int, default=2)
    glue.add_flags(p)
    p.add_argument("--quick", action="store_true", help="hidden 32 at length 32 for a few seconds an arm (the test)")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.seconds, args.chunk_seconds, args.evals = "32", "3", 1.0, 2
        args.tokens_per_batch, args.hidden, args.heads, args.warmup_steps = 256, 32, 2, 2
        args.dupe_factor, args.num_workers = 1, 1
        args.glue_train_rows, args.glue_seeds, args.glue_epochs = 32, "1,2", 1.0
        args.glue_batch, args.glue_max_seq_length = 8, 32
    lengths = [int(x) for x in args.lengths.split(",") if x]
    seconds = [float(x) for x in args.seconds.split(",") if x]
    if len(seconds) != len(lengths):
        p.error(f"--seconds={args.seconds} needs one value per --lengths={args.lengths}")
    for length in lengths:
        if length > 512:
            p.error(f"--lengths: {length} is past BERT's 512 learned positions")
    args.lengths, args.seconds = lengths, dict(zip(lengths, seconds))
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.workdir = os.path.abspath(args.workdir)
    glue.check_flags(p, args)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    started = time.time()
    corpus = os.path.join(args.workdir, "corpus")
    corpus_info = stage_corpus(args.corpus_dir, corpus)
    report = {"issue": 72, "quick": args.quick, "corpus": corpus_info, "records": {}, "runs": [],
              "settings": {k: v for k, v in vars(args).items() if k not in ("lengths", "seconds")}
              | {"seconds": {str(k): v for k, v in args.seconds.items()}, "lengths": args.lengths}}
    for length in args.lengths:
        records = os.path.join(args.workdir, f"records_{length}")
        report["records"][length] = stage_records(corpus, records, args.vocab_file, dupe_factor=args.dupe_factor,
                                                  seq_len=length, predictions=predictions(length),
                                                  workers=args.num_workers)
        for seed in args.seeds:
            report["runs"].append(compare(args, length, seed, records,
                                          os.path.join(args.workdir, f"len{length}_seed{seed}")))
    report["pretraining_wall_s"] = round(time.time() - started, 1)
    path = os.path.join(args.workdir, "modernbert_vs_bert.json")
    if args.glue_tasks:
        _write_json(path, report)  # the pretraining's results kept, whatever the fine-tuning does
        report["glue"] = glue.stage(args, report, lambda: _write_json(path, report))
    report["wall_s"] = round(time.time() - started, 1)
    _write_json(path, report)
    print(markdown(report), flush=True)
    if args.glue_tasks:
        print("\n" + glue.markdown(report["glue"]), flush=True)
    log(f"wrote {path}")
    return report


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


if __name__ == "__main__":
    main()
