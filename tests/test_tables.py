"""The one number format and table helper of the bench report and the model card (issue #27: one home per rule)."""

import pytest

from dspark_hf.evaluation.tables import counted, format_number, markdown_table


@pytest.mark.parametrize(("value", "digits", "text"), [
    (None, None, "–"), (None, 2, "–"),  # not measured
    (0.12345, None, "0.123"), (-0.5, None, "-0.500"),  # below 1 in magnitude: 3 decimals
    (1.0, None, "1.00"), (2.345, None, "2.35"), (99.994, None, "99.99"),  # below 100: 2
    (100.0, None, "100.0"), (1234.56, None, "1234.6"),  # from 100 on: 1
    (0.12345, 2, "0.12"), (1234.56, 2, "1234.56"), (2.25, 1, "2.2"), (0.7, 3, "0.700"),  # fixed decimals
    (3, None, "3"), (3, 2, "3"), (True, 2, "True"), ("gpu", None, "gpu"),  # not floats: as written
])
def test_format_number_values(value, digits, text):
    assert format_number(value, digits) == text


def test_markdown_table_formats_every_cell():
    assert markdown_table(["a", "b"], [[0.5, None], [2, 150.0]], format_number) == (
        "| a | b |\n|---|---|\n| 0.500 | – |\n| 2 | 150.0 |")


@pytest.mark.parametrize(("n", "noun", "text"), [
    (1, "prompt", "1 prompt"), (3, "prompt", "3 prompts"), (0, "prompt", "0 prompts"),  # 0 takes the plural
    (2, "plain run", "2 plain runs"), (1, "plain run", "1 plain run"),  # a phrase: the s on its last word
])
def test_counted_puts_the_noun_in_the_number_of_the_count(n, noun, text):
    assert counted(n, noun) == text
