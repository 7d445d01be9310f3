//! Shared helpers of the benches and the report.
