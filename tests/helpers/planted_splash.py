"""The TPU's splash attention kernel planted on a CPU, for tests of what reaches it."""

from bert_jax.model import attention


def interpreted_splash(monkeypatch) -> list:
    """Makes `attention._splash_applies` say yes and runs `attention._splash_attention` in Pallas'
    interpreter; returns the list each call's keyword arguments (`causal`, `local_window`, ...) are
    appended to, one per traced call."""
    calls, kernel = [], attention._splash_attention

    def splash(*args, **kwargs):
        calls.append(kwargs)
        return kernel(*args, **kwargs, interpret=True)

    monkeypatch.setattr(attention, "_splash_applies", lambda query: True)
    monkeypatch.setattr(attention, "_splash_attention", splash)
    return calls
