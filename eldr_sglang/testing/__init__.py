"""Test-only helpers. Nothing under eldr_sglang.testing is used by the product."""
