package io.pelican.examples.notifications;

import io.lettuce.core.RedisURI;
import io.pelican.worker.Message;
import io.pelican.worker.Outcome;
import io.pelican.worker.Worker;
import org.springframework.beans.factory.annotation.Value;
import org.springframework.boot.SpringApplication;
import org.springframework.boot.autoconfigure.SpringBootApplication;
import org.springframework.context.annotation.Bean;

/** Seed 001's notification worker: no @Scheduled XCLAIM loop, no dead-letter table; the group's policy does both. */
@SpringBootApplication
public class NotificationsApplication {
    public static void main(String[] args) {
        SpringApplication.run(NotificationsApplication.class, args);
    }

    /** start() once made (it refuses a newer contract); close() at shutdown finishes or gives back what is in hand. */
    @Bean(initMethod = "start", destroyMethod = "close")
    Worker notificationWorker(NotificationService notifications, @Value("${spring.data.redis.url}") String url) {
        return Worker.builder(RedisURI.create(url)).stream("subscribed-stream").group("notification")
                .handler(message -> handle(notifications, message)).build();
    }

    /** One message of the subscribed stream: notify the subscriber of the target's news. */
    static Outcome handle(NotificationService notifications, Message message) throws Exception {
        long subscriberId = Long.parseLong(message.text("subscriberId"));
        long targetId = Long.parseLong(message.text("targetId"));
        try {
            notifications.send(subscriberId, targetId, message.id()); // a provider outage throws: retried by the policy
        } catch (NotificationService.RecipientNotFoundException e) {
            return Outcome.terminal("RecipientNotFound"); // acknowledged and counted, never retried
        }
        return Outcome.done();
    }
}
