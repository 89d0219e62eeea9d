//! taskgate: Nomad's task lifecycle coordinator as an HTTP service.
//!
//! Layers, each a folder: `lifecycle` (pure rules), `registry` (runtime
//! state and waiting), `store` (durability), `http` (axum and OpenAPI).

pub mod agent;
pub mod agent_check;
pub mod app;
pub mod cli;
pub mod client;
pub mod config;
pub mod dump;
pub mod health;
#[doc(hidden)]
pub mod http;
pub mod lifecycle;
pub mod logs;
pub mod metrics;
pub mod operator;
pub mod registry;
pub mod secret;
pub mod server;
pub mod signals;
pub mod store;
pub mod supervise;
pub mod telemetry;
pub mod units;
pub mod wire;
