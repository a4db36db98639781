//! Typed refusals of the broker. Every message carries the numbers a user needs to act on it.

use serde::{Deserialize, Serialize};

use crate::Bytes;

/// Why a tenant could not connect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum AdmissionError {
    #[error("tenant name `{name}` is already connected (pid {pid})")]
    NameInUse { name: String, pid: u32 },
    #[error("unknown class `{class}`; configured classes: {known}")]
    UnknownClass { class: String, known: String },
    #[error("tenant `{name}` asks for a guarantee of {guarantee} above its limit of {limit}")]
    GuaranteeAboveLimit {
        name: String,
        guarantee: Bytes,
        limit: Bytes,
    },
    #[error(
        "tenant `{name}` asks for a guarantee of {guarantee}, more than the device's {capacity}"
    )]
    GuaranteeAboveCapacity {
        name: String,
        guarantee: Bytes,
        capacity: Bytes,
    },
    #[error(
        "tenant `{name}` asks for a guarantee of {guarantee}, but only {free} of the device's {capacity} \
         is free to guarantee ({guaranteed} is guaranteed to others, {borrowed} lent above guarantees, \
         {outside} in use outside vramd's books)"
    )]
    GuaranteeUnavailable {
        name: String,
        guarantee: Bytes,
        free: Bytes,
        capacity: Bytes,
        guaranteed: Bytes,
        borrowed: Bytes,
        outside: Bytes,
    },
    #[error("invalid tenant name `{name}`: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error(
        "uid {uid} (groups {gids:?}) may not connect as tenant `{name}`: its declaration names \
         owners {owners:?} and groups {groups:?} (tenants.{name}.owners, tenants.{name}.groups)"
    )]
    NotOwner {
        name: String,
        uid: u32,
        #[serde(default)]
        gids: Vec<u32>,
        owners: Vec<u32>,
        #[serde(default)]
        groups: Vec<u32>,
    },
    #[error(
        "tenant `{name}` (uid {uid}) asks for class `{class}` (priority {priority}), above the \
         default class (priority {default_priority}); only the uids in classes.{class}.users and \
         the members of classes.{class}.groups may"
    )]
    ClassNotAllowed {
        name: String,
        class: String,
        priority: u32,
        uid: u32,
        default_priority: u32,
    },
    #[error("uid {uid} has {max} tenants connected, its most (users.{uid}.max_tenants); `{name}` is refused")]
    UserTenants { name: String, uid: u32, max: usize },
    #[error(
        "tenant `{name}` asks for a guarantee of {guarantee}; uid {uid}'s tenants already hold or \
         are promised {held} of its {max} (users.{uid}.max_memory)"
    )]
    UserMemory {
        name: String,
        uid: u32,
        guarantee: Bytes,
        max: Bytes,
        held: Bytes,
    },
}

impl AdmissionError {
    /// A short, stable name for the rule that refused, for programs (`ErrorReply::reason`).
    pub fn reason(&self) -> &'static str {
        match self {
            AdmissionError::NameInUse { .. } => "name_in_use",
            AdmissionError::UnknownClass { .. } => "unknown_class",
            AdmissionError::GuaranteeAboveLimit { .. }
            | AdmissionError::GuaranteeAboveCapacity { .. } => "guarantee_above_limit",
            AdmissionError::GuaranteeUnavailable { .. } => "guarantee_unavailable",
            AdmissionError::BadName { .. } => "bad_name",
            AdmissionError::NotOwner { .. } => "not_owner",
            AdmissionError::ClassNotAllowed { .. } => "class_not_allowed",
            AdmissionError::UserTenants { .. } => "user_tenants",
            AdmissionError::UserMemory { .. } => "user_memory",
        }
    }
}

/// Why a request for memory was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum GrantError {
    #[error("unknown tenant id {0}")]
    UnknownTenant(u64),
    #[error("tenant `{tenant}` asked for {asked}; its limit is {limit} and it holds {held}")]
    OverLimit {
        tenant: String,
        asked: Bytes,
        limit: Bytes,
        held: Bytes,
    },
    #[error(
        "tenant `{tenant}` asked for {asked} above its guarantee of {guarantee} (it holds {held}); \
         only {free} of the device's {capacity} is free to borrow"
    )]
    DeviceFull {
        tenant: String,
        asked: Bytes,
        held: Bytes,
        guarantee: Bytes,
        free: Bytes,
        capacity: Bytes,
    },
    #[error(
        "tenant `{tenant}` (class `{class}`, priority {priority}) asked to borrow {asked} (it holds {held}, \
         guarantee {guarantee}); the last {reserve} of free memory is kept for higher-priority tenants \
         and only {free} is free"
    )]
    PriorityReserve {
        tenant: String,
        class: String,
        priority: u32,
        asked: Bytes,
        held: Bytes,
        guarantee: Bytes,
        reserve: Bytes,
        free: Bytes,
    },
    #[error(
        "tenant `{tenant}` asked for {asked}; uid {uid}'s tenants hold {held} of its {max} \
         (users.{uid}.max_memory)"
    )]
    UserLimit {
        tenant: String,
        asked: Bytes,
        uid: u32,
        max: Bytes,
        held: Bytes,
    },
    #[error("tenant `{tenant}` asked for {asked}, which is not a valid size: {reason}")]
    BadSize {
        tenant: String,
        asked: Bytes,
        reason: &'static str,
    },
}

impl GrantError {
    /// A short, stable name for metrics and reports (`over_limit`, `device_full`, ...).
    pub fn reason(&self) -> &'static str {
        match self {
            GrantError::UnknownTenant(_) => Self::REASONS[0],
            GrantError::OverLimit { .. } => Self::REASONS[1],
            GrantError::DeviceFull { .. } => Self::REASONS[2],
            GrantError::PriorityReserve { .. } => Self::REASONS[3],
            GrantError::UserLimit { .. } => Self::REASONS[4],
            GrantError::BadSize { .. } => Self::REASONS[5],
        }
    }

    /// Every name [`GrantError::reason`] gives.
    pub const REASONS: [&'static str; 6] = [
        "unknown_tenant",
        "over_limit",
        "device_full",
        "priority_reserve",
        "user_limit",
        "bad_size",
    ];
}
