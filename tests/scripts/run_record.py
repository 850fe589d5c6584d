"""What the test scripts write after training, for tests/test_launcher.py to compare.

Imported from the scripts' own folder, so it also proves that the launcher puts the
script's folder first on ``sys.path``, as ``python SCRIPT`` does.
"""


import torch


def save_run(trainer, model, path: str) -> None:
    """Writes the log history, losses, gradient norms, final weights, the Trainer's class
    chain, and whether the model carries a STRONGHOLD engine (the attribute
    ``stronghold_hf.get_engine`` reads: the scripts themselves never import stronghold_hf)."""
    history = trainer.state.log_history
    torch.save({
        "history": history,
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "trainer_mro": [c.__name__ for c in type(trainer).__mro__],
        "engine": getattr(model, "_stronghold_engine", None) is not None,
        # Models the trainer runs next to the trained one (TRL's reference model): the ledger
        # of the engine each carries, or None.
        "auxiliary": {name: _ledger(getattr(trainer, name, None)) for name in ("ref_model", "teacher_model")},
        "auxiliary_state": {name: {k: v.clone() for k, v in m.state_dict().items()}
                            for name in ("ref_model", "teacher_model")
                            if isinstance(m := getattr(trainer, name, None), torch.nn.Module)},
    }, path)


def _ledger(model):
    engine = getattr(model, "_stronghold_engine", None)
    if engine is None:
        return None
    return dict(engine.memory_stats(), blocks=len(engine.blocks))
