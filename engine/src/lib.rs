//! Engine: requests, the decode loop, metrics.
