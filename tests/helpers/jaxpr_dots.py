"""The dot_generals a traced program runs: what the mixed-matmul tests check (bf16 in, float32 out)."""

import jax


def dot_dtypes(jaxpr) -> list:
    """Every dot_general of `jaxpr` (a Jaxpr or a ClosedJaxpr) and of its sub-jaxprs (scans, custom
    VJPs, pjit calls): `((lhs dtype, rhs dtype), output dtype)` each, as strings."""
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name == "dot_general":
            found.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += dot_dtypes(sub)
    return found
