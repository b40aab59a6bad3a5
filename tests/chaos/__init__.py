"""Fault-injection suite: real servers, real workers, random faults, an independent checker.

``python -m tests.chaos --duration 120 --seed 7`` runs it (see
:mod:`tests.chaos.runner`); :mod:`tests.chaos.checker` states the invariants
it proves.
"""
