"""RESULTS.md rows of Selective attention (Leviathan et al., 2024): not written yet."""

from __future__ import annotations

from experiments.report import Section

SECTION = Section(title='Selective attention (Leviathan et al., 2024)', source='selective-attention.md', rows=(),
                  intro='No rows yet.')
