//! Validated identifiers: parse once at the edge, trust afterwards.

use std::{borrow::Borrow, fmt, sync::Arc};

/// Longest identifier accepted.
pub const MAX_ID_LEN: usize = 128;

/// Why a string is not an identifier.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("must not be empty")]
    Empty,
    #[error("must be at most {MAX_ID_LEN} characters")]
    TooLong,
    #[error("must start with a letter or digit")]
    BadStart,
    #[error("may only contain A-Z a-z 0-9 . _ - (found {0:?})")]
    BadChar(char),
}

fn check(s: &str) -> Result<(), IdError> {
    let first = s.chars().next().ok_or(IdError::Empty)?;
    if s.len() > MAX_ID_LEN {
        return Err(IdError::TooLong);
    }
    if !first.is_ascii_alphanumeric() {
        return Err(IdError::BadStart);
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(IdError::BadChar(c));
    }
    Ok(())
}

macro_rules! id_type {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Parses and validates an identifier.
            pub fn parse(s: &str) -> Result<Self, IdError> {
                check(s)?;
                Ok(Self(Arc::from(s)))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::parse(&s).map_err(serde::de::Error::custom)
            }
        }
    };
}

id_type!(
    /// An allocation ID: 1 to 128 characters from `A-Z a-z 0-9 . _ -`,
    /// starting with a letter or digit.
    AllocId
);
id_type!(
    /// A task name, with the same syntax as an allocation ID.
    TaskName
);
id_type!(
    /// A semaphore's name, with the same syntax as an allocation ID.
    SemName
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet() {
        for ok in ["a", "0", "web-1.b_c", "A9", &"x".repeat(MAX_ID_LEN)] {
            assert!(AllocId::parse(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_everything_else() {
        assert_eq!(AllocId::parse(""), Err(IdError::Empty));
        assert_eq!(
            AllocId::parse(&"x".repeat(MAX_ID_LEN + 1)),
            Err(IdError::TooLong)
        );
        assert_eq!(TaskName::parse(".."), Err(IdError::BadStart));
        assert_eq!(TaskName::parse("-a"), Err(IdError::BadStart));
        assert_eq!(TaskName::parse("a/b"), Err(IdError::BadChar('/')));
        assert_eq!(TaskName::parse("a b"), Err(IdError::BadChar(' ')));
        assert_eq!(TaskName::parse("é"), Err(IdError::BadStart));
        assert_eq!(TaskName::parse("a\u{0}"), Err(IdError::BadChar('\u{0}')));
    }
}
