pub mod bench;
pub mod check;
pub mod dashboard;
pub mod eval;
pub mod hf;
pub mod prepare;
pub mod sample;
pub mod train;
