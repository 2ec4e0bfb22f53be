//! `ember serve`: an OpenAI-compatible HTTP server over an ember model, with continuous batching
//! (requests join and leave the running decode batch at token granularity, see
//! [`ember_generate::engine`]), streaming as server-sent events, and a chat page.

mod answer;
pub mod api;
pub mod bench;
pub mod chat;
pub mod sampling;
pub mod server;
mod stream;
pub mod tools;
pub mod worker;

pub use ember_http::{Limits, StartError};
pub use server::{Options, Server};
pub use worker::Worker;
