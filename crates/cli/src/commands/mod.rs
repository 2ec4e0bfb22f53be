pub mod bench;
pub mod prepare;
pub mod sample;
pub mod train;
