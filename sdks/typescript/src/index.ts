export { Worker } from "./worker.js";
export type { Handler, HandlerContext, Logger, RunOptions, WorkerOptions, WorkerStats } from "./worker.js";
export { Message } from "./message.js";
export { done, retry, terminal, validateReason, InvalidReasonError, REASON_PATTERN } from "./outcome.js";
export type { Outcome } from "./outcome.js";
export {
  KNOWN_CONTRACT_VERSIONS,
  ContractVersionError,
  parseSettings,
  leaseIntervalMs,
  type WorkerSettings,
} from "./settings.js";
export {
  hashTag,
  settingsKey,
  terminalKey,
  errorsKey,
  consumersKey,
  boundsKey,
  rejectedKey,
  partitionStream,
  topicKey,
  membersKey,
  ownersKey,
  epochsKey,
  KEY_FIELD,
  TOPIC_CONTRACT_VERSION,
} from "./keys.js";
export { podName, type ClusterTarget, type Connection, type RedisTarget } from "./connection.js";
export {
  Producer,
  IdempotentProducer,
  PublishError,
  PublishRefused,
  PublishUnavailable,
  PublishFailed,
  PublishOutcomeUnknown,
  IdempotenceUnsupported,
} from "./producer.js";
export type { Fields, ProducerOptions, Published } from "./producer.js";
export {
  partitionOf,
  MAX_PARTITIONS,
  TopicProducer,
  IdempotentTopicProducer,
  TopicError,
  NotATopic,
  UnknownTopicContract,
  TopicUnavailable,
} from "./topic.js";
export type { MessageKey, TopicPublished, TopicPublishOptions } from "./topic.js";
export {
  TopicWorker,
  UnknownOrdering,
  DEFAULT_TTL_MS,
  describeTopicSettings,
  parseAssignment,
} from "./topic-worker.js";
export type {
  Assignment,
  Ordering,
  TopicDescription,
  TopicHandler,
  TopicHandlerContext,
  TopicWorkerOptions,
} from "./topic-worker.js";
