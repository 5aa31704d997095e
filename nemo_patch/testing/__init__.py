"""Test and demo aids for nemo_patch. Nothing here is imported by the product code paths."""
