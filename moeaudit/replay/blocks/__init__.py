"""The replay's forward of each block kind (``spec.blocks``), one module per kind, and the decoder
layer over them (:mod:`.layer`, with the registry from a token mixer's kind to its forward)."""
