"""mHC's Sinkhorn normalisation of the small stream-mixing matrices, in one launch."""
