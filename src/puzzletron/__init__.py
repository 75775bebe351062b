"""Puzzletron: distillation-based neural architecture search. This distribution ships its data stage."""
