//! Kubernetes versions table, verified downloads and safe archive extraction.
