"""The conformance suite every Pallas-Flash backend must pass.

Run it against one backend::

    pytest --pyargs pallas_flash_conformance --backend NAME

It reads the backend's declared capabilities, checks each of them against the float64 NumPy
reference in `pallas_flash_conformance.reference`, and checks that every capability the
backend does not declare raises `pallas_flash.UnsupportedFeatureError`.
"""
