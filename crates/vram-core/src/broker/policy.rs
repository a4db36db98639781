//! The broker's configuration: capacity, classes and pre-declared tenants.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Bytes;

/// A priority class. Higher `priority` wins under pressure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Class {
    pub priority: u32,
    /// Guarantee given to a tenant of this class that does not ask for one.
    #[serde(default)]
    pub default_guarantee: Bytes,
    /// Limit given to a tenant of this class that does not ask for one (`None`: the whole device).
    #[serde(default)]
    pub default_limit: Option<Bytes>,
}

/// A tenant the operator declared ahead: its guarantee is reserved from start-up, whether or not it
/// is connected, and its settings override what the connecting process asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredTenant {
    pub class: String,
    #[serde(default)]
    pub guarantee: Bytes,
    pub limit: Option<Bytes>,
}

/// Everything the broker needs to decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub capacity: Bytes,
    pub classes: BTreeMap<String, Class>,
    pub tenants: BTreeMap<String, DeclaredTenant>,
    /// Free memory that only the highest-priority class present may borrow into.
    pub priority_reserve: Bytes,
}

impl Policy {
    /// The built-in classes: `high` (priority 100), `normal` (50, the default) and `low` (10).
    pub fn default_classes() -> BTreeMap<String, Class> {
        [("high", 100), ("normal", 50), ("low", 10)]
            .into_iter()
            .map(|(n, p)| {
                let class = Class {
                    priority: p,
                    default_guarantee: Bytes::ZERO,
                    default_limit: None,
                };
                (n.to_string(), class)
            })
            .collect()
    }

    /// A policy with the default classes and a priority reserve of 1/32 of the capacity.
    pub fn with_capacity(capacity: Bytes) -> Policy {
        Policy {
            capacity,
            classes: Self::default_classes(),
            tenants: BTreeMap::new(),
            priority_reserve: Bytes(capacity.get() / 32),
        }
    }

    /// The class a tenant gets when it names none.
    pub const DEFAULT_CLASS: &'static str = "normal";
}
