//! Query parameters of the blocking routes: `index`, `wait` (a duration
//! with a unit), and the list's paging.

use std::time::Duration;

use super::extract::{Pairs, QueryParams};
use crate::lifecycle::{AllocId, FieldError, ListState};
use crate::units::parse_duration;

fn parse_wait(pairs: &Pairs, errors: &mut Vec<FieldError>) -> Option<Duration> {
    let raw = pairs.get("wait")?;
    parse_duration(raw)
        .map_err(|e| errors.push(FieldError::new("wait", e)))
        .ok()
}

fn parse_index(pairs: &Pairs, errors: &mut Vec<FieldError>) -> u64 {
    match pairs.get("index") {
        None => 0,
        Some(raw) => match raw.parse::<u64>() {
            Ok(n) if n <= MAX_INDEX => n,
            _ => {
                errors.push(FieldError::new(
                    "index",
                    format!("{raw:?} is not an integer index from 0 to {MAX_INDEX}"),
                ));
                0
            }
        },
    }
}

/// `prefix`: empty, or the start of an allocation ID.
fn parse_prefix(pairs: &Pairs, errors: &mut Vec<FieldError>) -> String {
    let prefix = pairs.get("prefix").unwrap_or_default().to_owned();
    // Every non-empty prefix of an allocation ID is itself a valid ID,
    // so a prefix that is not could never match: a typo, not a query.
    if !prefix.is_empty()
        && let Err(e) = AllocId::parse(&prefix)
    {
        errors.push(FieldError::new(
            "prefix",
            format!("{prefix:?} {e}, so no allocation ID starts with it"),
        ));
    }
    prefix
}

/// The largest `index` a blocking query takes: the int64 range the OpenAPI
/// document states (the server's own indexes never come near it).
pub const MAX_INDEX: u64 = i64::MAX as u64;

/// `?index=N&wait=D` of a blocking query.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BlockingParams {
    /// Wait for a `modify_index` greater than this; 0 answers at once.
    pub index: u64,
    pub wait: Option<Duration>,
}

impl QueryParams for BlockingParams {
    const NAMES: &'static [&'static str] = &["index", "wait"];

    fn from_pairs(pairs: &Pairs) -> Result<Self, Vec<FieldError>> {
        let mut errors = Vec::new();
        let index = parse_index(pairs, &mut errors);
        let wait = parse_wait(pairs, &mut errors);
        if errors.is_empty() {
            Ok(Self { index, wait })
        } else {
            Err(errors)
        }
    }
}

/// `?wait=D` of the start-condition long-poll.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WaitParams {
    pub wait: Option<Duration>,
}

impl QueryParams for WaitParams {
    const NAMES: &'static [&'static str] = &["wait"];

    fn from_pairs(pairs: &Pairs) -> Result<Self, Vec<FieldError>> {
        let mut errors = Vec::new();
        let wait = parse_wait(pairs, &mut errors);
        if errors.is_empty() {
            Ok(Self { wait })
        } else {
            Err(errors)
        }
    }
}

/// `?index=N&prefix=P` of the event stream.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StreamParams {
    /// Changes after this index.
    pub index: u64,
    pub prefix: String,
}

impl QueryParams for StreamParams {
    const NAMES: &'static [&'static str] = &["index", "prefix"];

    fn from_pairs(pairs: &Pairs) -> Result<Self, Vec<FieldError>> {
        let mut errors = Vec::new();
        let index = parse_index(pairs, &mut errors);
        let prefix = parse_prefix(pairs, &mut errors);
        if errors.is_empty() {
            Ok(Self { index, prefix })
        } else {
            Err(errors)
        }
    }
}

/// Page size bounds of the allocation list.
pub const MAX_PER_PAGE: usize = 1000;
pub const DEFAULT_PER_PAGE: usize = 100;

/// `?prefix=&per_page=&next_token=&state=` of the allocation list.
#[derive(Debug, PartialEq, Eq)]
pub struct ListParams {
    pub prefix: String,
    pub per_page: usize,
    pub next_token: Option<AllocId>,
    /// Only allocations in one of these (comma-separated); empty: all.
    pub state: Vec<ListState>,
}

impl QueryParams for ListParams {
    const NAMES: &'static [&'static str] = &["prefix", "per_page", "next_token", "state"];

    fn from_pairs(pairs: &Pairs) -> Result<Self, Vec<FieldError>> {
        let mut errors = Vec::new();
        let prefix = parse_prefix(pairs, &mut errors);
        let per_page = match pairs.get("per_page") {
            None => DEFAULT_PER_PAGE,
            Some(raw) => match raw.parse::<usize>() {
                Ok(n) if (1..=MAX_PER_PAGE).contains(&n) => n,
                _ => {
                    errors.push(FieldError::new(
                        "per_page",
                        format!("{raw:?} must be an integer from 1 to {MAX_PER_PAGE}"),
                    ));
                    DEFAULT_PER_PAGE
                }
            },
        };
        // A token is the first ID of the next page; any ID is accepted and
        // the page starts at it (or at the prefix, if that comes later).
        let next_token = pairs
            .get("next_token")
            .and_then(|raw| match AllocId::parse(raw) {
                Ok(id) => Some(id),
                Err(e) => {
                    errors.push(FieldError::new("next_token", format!("{raw:?} {e}")));
                    None
                }
            });
        let mut state = Vec::new();
        for raw in pairs
            .get("state")
            .into_iter()
            .flat_map(|raw| raw.split(','))
        {
            match raw.parse::<ListState>() {
                Ok(s) if !state.contains(&s) => state.push(s),
                Ok(_) => {}
                Err(e) => errors.push(FieldError::new("state", e.to_string())),
            }
        }
        if errors.is_empty() {
            Ok(Self {
                prefix,
                per_page,
                next_token,
                state,
            })
        } else {
            Err(errors)
        }
    }
}
