"""Puzzletron: distillation-based neural architecture search; this distribution holds its data stage."""

__all__: list[str] = []
