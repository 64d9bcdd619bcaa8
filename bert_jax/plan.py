"""`python -m bert_jax.plan`: plan a pod run before renting it (the command docs/pod_planning.md and
the README document). The planner is `bert_jax.pod.planning.planner`; its flags: `python -m bert_jax.plan --help`.

    pip install 'libtpu==0.0.42.*'      # the TPU compiler; no TPU needed
    python -m bert_jax.plan --config=configs/large.py --topology=v4-8,v4-32,v4-128,v4-512 \\
        [--mesh=data,fsdp,tensor] [--seq_len=128] [--batch_per_chip=32] [--recipes=paper,lamb] \\
        [--json=plan.json] [--config.model.attention_impl=dot_product ...]
"""

from bert_jax.pod.planning import planner

if __name__ == "__main__":
    planner.main()
